"""HF tensor names <-> our param paths, one ``Entry`` per param leaf (see the table in
``icml_jax/interop/__init__.py``). All transforms are numpy transposes/reshapes (exact)."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import ml_collections
import numpy as np

# Buffers some HF checkpoints carry that are not parameters (recomputed from the config).
IGNORABLE = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class Dims:
    V: int
    D: int
    L: int
    H: int
    G: int
    K: int
    F: int
    tied: bool
    qkv_bias: bool

    @property
    def R(self) -> int:
        return self.H // self.G

    @classmethod
    def of(cls, m: ml_collections.ConfigDict) -> "Dims":
        return cls(V=int(m.vocab_size), D=int(m.d_model), L=int(m.num_layers), H=int(m.num_heads),
                   G=int(m.num_kv_heads), K=int(m.head_dim), F=int(m.ffn_dim),
                   tied=bool(m.tie_embeddings), qkv_bias=bool(m.qkv_bias))


@dataclasses.dataclass(frozen=True)
class Entry:
    """One of our param leaves and the HF tensors it is made of.

    ``path`` is relative to the layer (``("attn", "qkv")``) when ``layer`` is not None, else absolute
    (``("io", "embedding")``). ``to_ours(*hf_arrays)`` and ``to_hf(ours) -> tuple`` are inverses."""
    path: tuple[str, ...]
    layer: int | None
    our_shape: tuple[int, ...]
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_ours: Callable[..., np.ndarray]
    to_hf: Callable[[np.ndarray], tuple[np.ndarray, ...]]

    def our_path(self, scanned: bool) -> tuple[str, ...]:
        if self.layer is None:
            return self.path
        return ("layers",) + self.path if scanned else (f"layer_{self.layer}",) + self.path


def _same(path, layer, shape, name):
    return Entry(path, layer, shape, (name,), (shape,), lambda a: a, lambda w: (w,))


def _transposed(path, layer, our_shape, name):
    return Entry(path, layer, our_shape, (name,), (our_shape[::-1],), lambda a: a.T, lambda w: (w.T,))


def io_entries(d: Dims) -> list[Entry]:
    out = [_same(("io", "embedding"), None, (d.V, d.D), "model.embed_tokens.weight"),
           _same(("io", "final_norm", "scale"), None, (d.D,), "model.norm.weight")]
    if not d.tied:
        out.append(_transposed(("io", "lm_head"), None, (d.D, d.V), "lm_head.weight"))
    return out


def _qkv(d: Dims, i: int, p: str) -> Entry:
    D, G, R, K = d.D, d.G, d.R, d.K

    def to_ours(q, k, v):  # [H*K, D], [G*K, D], [G*K, D] -> [D, G, R+2, K]
        return np.concatenate([q.T.reshape(D, G, R, K), k.T.reshape(D, G, 1, K),
                               v.T.reshape(D, G, 1, K)], axis=2)

    def to_hf(w):
        return (w[:, :, :R].reshape(D, G * R * K).T, w[:, :, R].reshape(D, G * K).T,
                w[:, :, R + 1].reshape(D, G * K).T)

    names = tuple(f"{p}self_attn.{x}_proj.weight" for x in "qkv")
    return Entry(("attn", "qkv"), i, (D, G, R + 2, K), names,
                 ((d.H * K, D), (G * K, D), (G * K, D)), to_ours, to_hf)


def _qkv_bias(d: Dims, i: int, p: str) -> Entry:
    G, R, K = d.G, d.R, d.K

    def to_ours(q, k, v):  # [H*K], [G*K], [G*K] -> [G, R+2, K]
        return np.concatenate([q.reshape(G, R, K), k.reshape(G, 1, K), v.reshape(G, 1, K)], axis=1)

    def to_hf(b):
        return b[:, :R].reshape(-1), b[:, R].reshape(-1), b[:, R + 1].reshape(-1)

    names = tuple(f"{p}self_attn.{x}_proj.bias" for x in "qkv")
    return Entry(("attn", "qkv_bias"), i, (G, R + 2, K), names, ((d.H * K,), (G * K,), (G * K,)),
                 to_ours, to_hf)


def _out(d: Dims, i: int, p: str) -> Entry:
    G, R, K, D = d.G, d.R, d.K, d.D
    return Entry(("attn", "out"), i, (G, R, K, D), (f"{p}self_attn.o_proj.weight",),
                 ((D, d.H * K),), lambda o: o.T.reshape(G, R, K, D),
                 lambda w: (w.reshape(G * R * K, D).T,))


def _wi(d: Dims, i: int, p: str) -> Entry:
    return Entry(("mlp", "wi"), i, (d.D, 2, d.F),
                 (f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"), ((d.F, d.D), (d.F, d.D)),
                 lambda g, u: np.stack([g.T, u.T], axis=1), lambda w: (w[:, 0].T, w[:, 1].T))


def layer_entries(d: Dims, i: int) -> list[Entry]:
    p = f"model.layers.{i}."
    out = [_same(("attn_norm", "scale"), i, (d.D,), f"{p}input_layernorm.weight"),
           _qkv(d, i, p), _out(d, i, p),
           _same(("mlp_norm", "scale"), i, (d.D,), f"{p}post_attention_layernorm.weight"),
           _wi(d, i, p), _transposed(("mlp", "wo"), i, (d.F, d.D), f"{p}mlp.down_proj.weight")]
    if d.qkv_bias:
        out.insert(3, _qkv_bias(d, i, p))
    return out


def all_entries(d: Dims) -> list[Entry]:
    return io_entries(d) + [e for i in range(d.L) for e in layer_entries(d, i)]

