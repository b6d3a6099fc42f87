"""``load_hf`` / ``save_hf``: HF safetensors folders <-> (``config.model``, sharded params)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from icml_jax import sharding as mesh_lib
from icml_jax.interop import hf_config, hf_params
from icml_jax.interop.hf_params import Dims, Entry
from icml_jax.interop.safetensors_io import SafetensorsFile, write_safetensors

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
              "float16": np.dtype(np.float16)}


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


class Checkpoint:
    """The tensors of an HF folder: ``model.safetensors`` or shards listed in the index file."""

    def __init__(self, path: str):
        self.path = path
        index, single = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
        if os.path.exists(index):
            weight_map = _read_json(index).get("weight_map") or {}
            files = {f: SafetensorsFile(os.path.join(path, f)) for f in sorted(set(weight_map.values()))}
            self.where = {name: files[f] for name, f in weight_map.items()}
            for f, st in files.items():
                stray = sorted(set(st.keys()) - {n for n, g in weight_map.items() if g == f})
                if stray:
                    raise ValueError(f"{st.path}: tensors {stray[:5]} are not listed in {index}; "
                                     "the index does not match the shard files")
        elif os.path.exists(single):
            st = SafetensorsFile(single)
            self.where = {name: st for name in st.keys()}
        else:
            found = sorted(os.listdir(path)) if os.path.isdir(path) else "no such folder"
            raise FileNotFoundError(
                f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found (contents: {found}); only "
                "safetensors checkpoints are supported — re-save with "
                "`model.save_pretrained(dir, safe_serialization=True)`")

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].shape(name)

    def get(self, name: str) -> np.ndarray:
        return self.where[name].get(name)

    def file(self, name: str) -> str:
        return self.where[name].path


def _validate_tensors(ckpt: Checkpoint, entries: list[Entry], tied: bool) -> None:
    expected = {n: s for e in entries for n, s in zip(e.hf, e.hf_shapes)}
    missing = sorted(set(expected) - ckpt.names())
    if missing:
        raise ValueError(f"{ckpt.path}: checkpoint is missing tensor(s) {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all) that the "
                         "config.json needs; the weights do not match the config")
    extra = sorted(n for n in ckpt.names() - set(expected)
                   if not hf_params.IGNORABLE.match(n) and not (tied and n == "lm_head.weight"))
    if extra:
        raise ValueError(f"{ckpt.path}: unexpected tensor(s) {extra[:8]}"
                         f"{' ...' if len(extra) > 8 else ''} ({len(extra)} in all) in "
                         f"{ckpt.file(extra[0])}: config.json does not describe them (e.g. biases the "
                         "config does not enable) and dropping them would change the model")
    for name, shape in expected.items():
        if ckpt.shape(name) != tuple(shape):
            raise ValueError(f"{ckpt.path}: tensor {name!r} has shape {list(ckpt.shape(name))} in "
                             f"{ckpt.file(name)} but config.json implies {list(shape)}")
    if tied and "lm_head.weight" in ckpt.names():
        if ckpt.shape("lm_head.weight") != tuple(expected["model.embed_tokens.weight"]) or not np.array_equal(
                ckpt.get("lm_head.weight"), ckpt.get("model.embed_tokens.weight")):
            raise ValueError(f"{ckpt.path}: tie_word_embeddings=true but lm_head.weight differs from "
                             "model.embed_tokens.weight; set tie_word_embeddings=false in config.json")


def default_mesh_and_rules(mesh: Mesh | None, rules) -> tuple[Mesh, tuple]:
    if mesh is None:
        mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1)))
    if rules is None:
        rules = mesh_lib.logical_rules(hf_config.lm_base_config().mesh)
    return mesh, tuple((name, tuple(ax) if isinstance(ax, list) else ax) for name, ax in rules)


def _check_divisible(abstract_flat, shardings_flat, where: str) -> None:
    """Fails before any tensor is read if a param dimension does not split evenly over the mesh."""
    bad = []
    for leaf, a in abstract_flat.items():
        sh = shardings_flat[leaf]
        for dim, axes in zip(a.shape, sh.spec):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            n = int(np.prod([sh.mesh.shape[x] for x in axes], dtype=np.int64))
            if dim % n:
                bad.append(f"{'/'.join(leaf)} {tuple(a.shape)} spec {tuple(sh.spec)}")
                break
    if bad:
        raise ValueError(f"{where}: param(s) {bad[:4]} do not divide evenly over mesh "
                         f"{dict(next(iter(shardings_flat.values())).mesh.shape)}; choose mesh sizes "
                         "that divide these dimensions or map the axis to None in the rules")


def param_shardings(model_cfg: ml_collections.ConfigDict, mesh: Mesh, rules) -> tuple[Any, Any]:
    """(abstract params, NamedShardings) of ``Decoder(model_cfg)`` from its logical axis names."""
    from icml_jax.models import build_model  # pylint: disable=g-import-not-at-top

    model = build_model(model_cfg)
    tokens = jnp.zeros((1, min(8, int(model_cfg.max_seq_len))), jnp.int32)
    with mesh, nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(lambda r: model.init(r, tokens)["params"], jax.random.key(0))
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    return nn.meta.unbox(abstract), shardings


def _flat(tree) -> dict[tuple[str, ...], Any]:
    return {tuple(k.key for k in path): v for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _unflat(flat: dict[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def _check_model_matches(abstract_flat, entries: list[Entry], scanned: bool, L: int, what: str):
    ours = {}
    for e in entries:
        shape = ((L,) + e.our_shape) if (scanned and e.layer is not None) else e.our_shape
        ours[e.our_path(scanned)] = shape
    got = {p: tuple(a.shape) for p, a in abstract_flat.items()}
    if ours != got:
        only_map = sorted("/".join(p) for p in set(ours) - set(got))
        only_model = sorted("/".join(p) for p in set(got) - set(ours))
        bad = sorted("/".join(p) for p in set(ours) & set(got) if ours[p] != got[p])
        raise ValueError(
            f"{what}: the param tree of Decoder(config.model) does not match the HF mapping "
            f"(mapped but not in the model: {only_map[:6]}; in the model but not mapped: "
            f"{only_model[:6]}; shape differs: {bad[:6]}). The model lacks a feature this checkpoint "
            "needs, or icml_jax/interop/hf_params.py is out of date.")


def load_hf(path: str, *, mesh: Mesh | None = None, rules=None, dtype: str = "float32",
            param_dtype: str = "float32", scan_layers: bool = False,
            remat: str = "none") -> tuple[ml_collections.ConfigDict, dict]:
    """Loads an HF Llama/Mistral/Qwen2 safetensors folder.

    Args:
        path: folder with ``config.json`` and ``model.safetensors`` (or shards + index).
        mesh, rules: where to place params (default: all local devices on a data-only mesh, the
            logical rules of ``configs/lm.py``); each param is built on the host one at a time and
            placed directly in its ``NamedSharding``, so models larger than one device fit a mesh.
        dtype: compute dtype (``config.model.dtype``).
        param_dtype: storage dtype of the returned params; ``"auto"`` = the checkpoint's dtype.
        scan_layers: return one stacked ``layers/...`` subtree (leading L axis) instead of
            ``layer_{i}``.
        remat: ``config.model.remat`` of the returned config.

    Returns:
        ``(model_cfg, params)``: ``Decoder(model_cfg).apply({"params": params}, tokens)``.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json; expected an HF model folder "
                                "(save_pretrained output)")
    hf = _read_json(cfg_path)
    m = hf_config.from_hf_config(hf, cfg_path)
    if param_dtype == "auto":
        param_dtype = hf_config.checkpoint_dtype(hf) or "float32"
    for key, val in (("dtype", dtype), ("param_dtype", param_dtype)):
        if val not in _NP_DTYPES:
            raise ValueError(f"load_hf({key}={val!r}): choose one of {sorted(_NP_DTYPES)}"
                             + (" or 'auto'" if key == "param_dtype" else ""))
    m.dtype, m.param_dtype, m.scan_layers, m.remat = dtype, param_dtype, bool(scan_layers), remat
    d = Dims.of(m)
    entries = hf_params.all_entries(d)
    ckpt = Checkpoint(path)
    _validate_tensors(ckpt, entries, d.tied)

    mesh, rules = default_mesh_and_rules(mesh, rules)
    abstract, shardings = param_shardings(m, mesh, rules)
    abstract, shardings = _flat(abstract), _flat(shardings)
    _check_model_matches(abstract, entries, m.scan_layers, d.L, path)
    _check_divisible(abstract, shardings, path)

    np_dt = _NP_DTYPES[param_dtype]
    by_leaf: dict[tuple[str, ...], list[Entry]] = {}
    for e in entries:
        by_leaf.setdefault(e.our_path(m.scan_layers), []).append(e)
    out = {}
    for leaf, group in by_leaf.items():
        host = _assemble(ckpt, group, m.scan_layers, np_dt)
        out[leaf] = jax.make_array_from_callback(host.shape, shardings[leaf], lambda idx, h=host: h[idx])
        del host
    return m, _unflat(out)


def _assemble(ckpt: Checkpoint, group: list[Entry], scanned: bool, np_dt) -> np.ndarray:
    """Host array of one of our leaves (stacked over layers when scanned), in ``np_dt``."""
    def one(e: Entry) -> np.ndarray:
        arrays = [ckpt.get(n) for n in e.hf]
        return np.asarray(e.to_ours(*arrays)).astype(np_dt)

    if not (scanned and group[0].layer is not None):
        return one(group[0])
    host = np.empty((len(group),) + group[0].our_shape, np_dt)
    for e in group:
        host[e.layer] = one(e)
    return host


# ----------------------------------------------------------------------------------------- export


def _leaf_getter(params: dict, d: Dims, scanned: bool):
    flat = _flat(params)

    def get(e: Entry) -> np.ndarray:
        p = e.our_path(scanned)
        if p not in flat and e.path == ("attn", "qkv_bias"):
            return np.zeros(e.our_shape, np.float32)  # Qwen2 export of a bias-free model
        x = flat[p]
        x = x[e.layer] if scanned and e.layer is not None else x
        return np.asarray(jax.device_get(x))

    return flat, get


def _check_params(flat, entries: list[Entry], scanned: bool, L: int, optional_bias: bool) -> None:
    want = {}
    for e in entries:
        if optional_bias and e.path == ("attn", "qkv_bias"):
            continue
        want[e.our_path(scanned)] = ((L,) + e.our_shape) if scanned and e.layer is not None else e.our_shape
    _check_shapes(flat, want, "save_hf: params do not match model_cfg")


def _check_shapes(flat, want: dict, what: str) -> None:
    """ValueError(``what`` + the missing / unexpected / wrong-shape leaves) unless ``flat``'s
    leaves have exactly the shapes ``want`` gives."""
    got = {p: tuple(np.shape(v)) for p, v in flat.items()}
    if want != got:
        missing = sorted("/".join(p) for p in set(want) - set(got))
        extra = sorted("/".join(p) for p in set(got) - set(want))
        bad = [f"{'/'.join(p)}: expected {want[p]}, found {got[p]}"
               for p in sorted(set(want) & set(got)) if want[p] != got[p]]
        raise ValueError(f"{what} (missing {missing[:6]}, unexpected {extra[:6]}, wrong shape "
                         f"{bad[:6]}); pass the params of Decoder(model_cfg) (the 'params' "
                         "collection, unboxed)")


def _shard_groups(entries: list[Entry], itemsize: int, max_bytes: int | None) -> list[list[Entry]]:
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        n = sum(int(np.prod(s)) for s in e.hf_shapes) * itemsize
        if max_bytes and groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += n
    return groups


def uniform_params(model_cfg: ml_collections.ConfigDict, params: dict,
                   where: str = "uniform_params") -> tuple[ml_collections.ConfigDict, dict]:
    """A heterogeneous child (``config.model.blocks``, models/hetero.py) in its parent's uniform
    shape: ``(parent config.model, params of Decoder(parent))`` computing the same function.

    Per layer: an FFN of width F_l < F gets zero gate/up columns and down rows (silu(0) * 0 = 0);
    G_l < G KV heads become G slots, slot j holding child head j // (G / G_l) (query head h = j*R + r
    reads slot h // R, whose child head h // R_l is the one it read before; q and o keep their head
    order); a no-op sub-block becomes a norm of ones with a zero output projection. Exact, but
    the padded model has the parent's size and cost. Refused (ValueError naming
    ``config.model.blocks`` and the layer): ``linear`` blocks, widths above ``ffn_dim``, KV-head
    counts that do not divide ``num_kv_heads``. A homogeneous config is returned unchanged."""
    from icml_jax.models import build_model, hetero  # pylint: disable=g-import-not-at-top
    from icml_jax.models.mlp import is_gated  # pylint: disable=g-import-not-at-top

    if not hetero.is_hetero(model_cfg):
        return model_cfg, params
    hetero.validate(model_cfg)
    m = model_cfg
    G, H, F, D, K = (int(m.num_kv_heads), int(m.num_heads), int(m.ffn_dim), int(m.d_model),
                     int(m.head_dim))
    if H % G:
        raise ValueError(f"{where}: config.model.num_kv_heads={G} does not divide num_heads={H}")
    lay = hetero.layout(m)
    for i, (a, f) in enumerate(lay):
        for key, e in (("attention", a), ("ffn", f)):
            if e == "linear":
                raise ValueError(
                    f"{where}: config.model.blocks.{key} layer {i} is 'linear' (a D x D map), which no "
                    f"Llama {'attention' if key == 'attention' else 'gated MLP'} computes exactly; only "
                    "KV-head counts, FFN widths and 'noop' can be exported")
        if isinstance(a, int) and (a > G or G % a):
            raise ValueError(f"{where}: config.model.blocks.attention layer {i} has {a} KV heads, which "
                             f"does not divide the parent's num_kv_heads={G}; a uniform checkpoint "
                             "with G KV heads holds it exactly only when it does")
        if isinstance(f, int) and f > F:
            raise ValueError(f"{where}: config.model.blocks.ffn layer {i} is {f} wide, above the "
                             f"parent's ffn_dim={F}; set config.model.ffn_dim to the largest width")
    if "layers" in params:
        raise ValueError(f"{where}: scanned params ('layers') for a per-layer layout; pass the "
                         "unscanned layer_{i} tree of Decoder(config.model)")
    tokens = jnp.zeros((1, min(8, int(m.max_seq_len))), jnp.int32)
    want = _flat(nn.meta.unbox(jax.eval_shape(
        lambda r: build_model(m).init(r, tokens)["params"], jax.random.key(0))))
    flat = _flat(params)
    _check_shapes(flat, {p: tuple(a.shape) for p, a in want.items()},
                  f"{where}: params do not match config.model.blocks")

    host = lambda x: np.asarray(jax.device_get(x))  # noqa: E731
    dt = np.asarray(host(flat[("io", "embedding")])).dtype
    R = H // G
    out = {p: host(v) for p, v in flat.items() if not p[0].startswith("layer_")}
    for i, (a, f) in enumerate(lay):
        p = f"layer_{i}"
        if a == "noop":
            out[(p, "attn_norm", "scale")] = np.ones((D,), dt)
            out[(p, "attn", "qkv")] = np.zeros((D, G, R + 2, K), dt)
            out[(p, "attn", "out")] = np.zeros((G, R, K, D), dt)
            if m.qkv_bias:
                out[(p, "attn", "qkv_bias")] = np.zeros((G, R + 2, K), dt)
        else:
            Rl, rep = H // a, G // a
            out[(p, "attn_norm", "scale")] = host(flat[(p, "attn_norm", "scale")])
            w = host(flat[(p, "attn", "qkv")])  # [D, a, Rl+2, K]
            out[(p, "attn", "qkv")] = np.concatenate(
                [w[:, :, :Rl].reshape(D, G, R, K), np.repeat(w[:, :, Rl:], rep, axis=1)], axis=2)
            out[(p, "attn", "out")] = host(flat[(p, "attn", "out")]).reshape(G, R, K, D)
            if m.qkv_bias:
                b = host(flat[(p, "attn", "qkv_bias")])  # [a, Rl+2, K]
                out[(p, "attn", "qkv_bias")] = np.concatenate(
                    [b[:, :Rl].reshape(G, R, K), np.repeat(b[:, Rl:], rep, axis=0)], axis=1)
        if f == "noop":
            out[(p, "mlp_norm", "scale")] = np.ones((D,), dt)
            out[(p, "mlp", "wi")] = np.zeros((D, 2, F) if is_gated(m.mlp.activation) else (D, F), dt)
            out[(p, "mlp", "wo")] = np.zeros((F, D), dt)
        else:
            out[(p, "mlp_norm", "scale")] = host(flat[(p, "mlp_norm", "scale")])
            wi, wo = host(flat[(p, "mlp", "wi")]), host(flat[(p, "mlp", "wo")])
            out[(p, "mlp", "wi")] = np.pad(wi, ((0, 0),) * (wi.ndim - 1) + ((0, F - f),))
            out[(p, "mlp", "wo")] = np.pad(wo, ((0, F - f), (0, 0)))
    parent = ml_collections.ConfigDict(m.to_dict() if hasattr(m, "to_dict") else dict(m))
    parent.blocks.attention = parent.blocks.ffn = ""
    return parent, _unflat(out)


def save_hf(path: str, model_cfg: ml_collections.ConfigDict, params: dict,
            architecture: str = "LlamaForCausalLM", *, dtype: str | None = None,
            max_shard_size: int | None = None, overwrite: bool = False,
            bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None,
            pad_token_id: int | None = None) -> str:
    """Writes ``config.json`` + safetensors that ``AutoModelForCausalLM.from_pretrained`` loads.

    Args:
        path: the output folder; written to a temporary sibling and renamed at the end, so a crash
            never leaves a half-written folder. An existing folder is replaced only if ``overwrite``.
        model_cfg, params: ``config.model`` and the unboxed param tree (``layer_{i}`` or scanned).
        architecture: ``LlamaForCausalLM`` | ``MistralForCausalLM`` | ``Qwen2ForCausalLM``.
        dtype: stored dtype (default: ``model_cfg.param_dtype``).
        max_shard_size: bytes per shard; if set and exceeded, writes ``model-0000i-of-0000n``
            shards plus ``model.safetensors.index.json``.
        bos/eos/pad_token_id: written to config.json when given.

    A heterogeneous child (``config.model.blocks``: Puzzle's per-layer KV heads / FFN widths /
    no-ops) is written in its parent's uniform Llama shape, padded exactly (``uniform_params``):
    config.json has num_key_value_heads = ``num_kv_heads`` and intermediate_size = ``ffn_dim``.
    The export keeps the child's function, not its savings (the padded checkpoint has the parent's
    parameters, FLOPs and KV cache). ``linear`` blocks are refused before anything is written.

    Returns:
        ``path``.
    """
    dtype = dtype or model_cfg.param_dtype
    if dtype not in _NP_DTYPES:
        raise ValueError(f"save_hf(dtype={dtype!r}): choose one of {sorted(_NP_DTYPES)}")
    if int(model_cfg.get("lowrank", 0) or 0):
        raise ValueError(f"save_hf: config.model.lowrank={model_cfg.lowrank} (low-rank factors beside "
                         "the kernels) has no Hugging Face layout; fold them in first with "
                         "icml_jax.compress.prune.merged_params(params, model_cfg) and save its result")
    model_cfg, params = uniform_params(model_cfg, params, "save_hf")  # a Puzzle child, padded
    hf = hf_config.to_hf_config(model_cfg, architecture, dtype, dict(
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id))
    d = Dims.of(model_cfg)
    scanned = "layers" in params
    optional_bias = architecture == "Qwen2ForCausalLM" and not d.qkv_bias
    if optional_bias:
        d = dataclasses.replace(d, qkv_bias=True)
    entries = hf_params.all_entries(d)
    flat, get = _leaf_getter(params, d, scanned)
    _check_params(flat, entries, scanned, d.L, optional_bias)

    np_dt = _NP_DTYPES[dtype]
    parent = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"save_hf: {path} exists; pass overwrite=True to replace it")
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.tmp-", dir=parent)
    try:
        groups = _shard_groups(entries, np_dt.itemsize, max_shard_size)
        n = len(groups)
        weight_map, total = {}, 0
        for k, group in enumerate(groups):
            fname = SINGLE_FILE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            specs = [(name, shape, np_dt) for e in group for name, shape in zip(e.hf, e.hf_shapes)]
            total += write_safetensors(os.path.join(tmp, fname), specs,
                                       _hf_arrays(group, get, np_dt), metadata={"format": "pt"})
            weight_map.update({s[0]: fname for s in specs})
        if n > 1:
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2, sort_keys=True)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _hf_arrays(group: list[Entry], get, np_dt) -> Iterator[tuple[str, np.ndarray]]:
    for e in group:
        for name, arr in zip(e.hf, e.to_hf(get(e))):
            yield name, np.asarray(arr).astype(np_dt)


def _replace_dir(tmp: str, path: str) -> None:
    """Moves the finished ``tmp`` folder to ``path`` (replacing an old one only at the very end)."""
    if not os.path.exists(path):
        os.rename(tmp, path)
        return
    old = f"{path}.old-{uuid.uuid4().hex[:8]}"
    os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
