"""Residual Matrix Transformer (Mak & Flanigan, ICML 2025; ``docs/methods/rmt.md``): ``residual="rmt"``.

Each token's residual is a matrix X [E, K] (an outer-product memory). Layers *store* a data vector
x [E] under a key s [K] (X += x ⊗ s) and *retrieve* with a key a [K] (x = X a). Attention has R
heads of width E; each head's q, k, v are retrievals and its output is stored under its own key.
The FFN retrieves R vectors, concatenates them (width R·E), applies the registry MLP
(``config.model.mlp.activation``, reference: ``gelu_tanh``), splits and stores. Embedding and
unembedding go through storage / retrieval as well.

Axis letters (shapes in names):
  B batch, T query length, S key length (cache slots), R rank = heads (``num_heads``),
  K key dim Dk (``rmt.key_dim``), E value dim Dv = head width (``head_dim``), C the q/k/v slot (3),
  D = R·E (the FFN's input/output width), F ffn hidden (``ffn_dim``), V vocab, N position table
  (``max_seq_len``).

Stream state: ``RMTState(x [B, T, E, K], layer [B, 1] int32)``; the layer counter travels with the
residual so that the inverse layer scaling (logits / (ℓ+1)) works under ``nn.scan`` too.

Params (logical axes in brackets; per layer under ``layer_i`` or stacked under ``layers``):
  io/embedding [V, R, E] (vocab, rmt_rank, rmt_value)   io/embed_store [R, K] (rmt_rank, rmt_key)
  io/pos_embedding [N, R, E] (learned positions only; stored with embed_store, as the paper counts)
  io/final_norm/scale [E, K]   io/unembed_retrieve [K, R]   io/unembed [R, E, V]
  attn_norm/scale [E, K]   qkv_retrieve [K, 3, R] (rmt_key, -, rmt_rank)   attn_store [R, K]
  mlp_norm/scale [E, K]    mlp_retrieve [K, R]   mlp/wi [D, F]   mlp/wo [F, D]   mlp_store [R, K]

Reference code read and checked (bmac3/residual-matrix-transformer @ 1afac0c; it was also run for
the parity fixture ``tests/models/data/rmt_reference.npz``):
  * RMSNorm over all E·K entries, eps inside the rsqrt, elementwise [E, K] gain (``RMSNorm`` with
    axis (ResVal, ResKey)); fp32 compute.
  * attention logits: (q·k) · attn_multiplier·sqrt(base_E)/E, then / (ℓ+1), then + ALiBi; the
    sqrt(base)/E muP factor equals 1/sqrt(E) at the repo's defaults (base = actual). ALiBi slopes
    are ``geomspace(2^(-8/R), 2^-8)`` = 2^(-8(r+1)/R); the bias is -(number of visible keys after
    s up to t) · m_r, which equals -m_r (t - s) inside a causal document. Here it is computed from
    per-document positions (identical for packed rows and left-padded decoding).
  * [spec "query zeroing is a no-op" — confirmed]: ``qkv_linear.set(...)`` returns a new module
    that is discarded, so the query slice starts random. ``rmt.query_zero_init`` applies it.
  * init (muP Table 8 as coded): embedding std = init_std (fan_in 1), hidden kernels
    std = init_std / sqrt(fan_in) with fan_in the product of the *actual* input axes, the
    attention-output and FFN store keys additionally × 1/sqrt(2L) (the embedding store key is
    not), the unembedding zero with multiplier output_multiplier / width_ratio(E·R). Norm gains 1.
  * [inferred, confirmed]: the optimizer is clip → Adam → per-group lr (peak lr,
    hidden ÷ width ratio) → add 1e-4·θ (masked) → × unit schedule. Width ratios are 1 unless
    base widths are given (``scripts/train.py`` gives none, so as executed the muP lr scaling is a
    no-op); ``rmt.base_*`` set them here. Decay: every hidden kernel (incl. the retrieval / store
    keys); not the embedding, the unembedding or the norm gains. See ``optimizer_groups``.
  * GELU is ``hax.nn.gelu`` with ``approximate=True`` (tanh). z-loss: CE + 1e-4·logZ², mean over
    positions (``icml_jax.tasks.lm``).
  * Mixed precision: linears in ``config.model.dtype`` (reference bf16), norms and attention in
    fp32, as here.

Paper variants behind flags (docs/methods/rmt.md): ``rmt.position="learned"`` (absolute table stored like the
token embedding, under the same store keys so the parameter count is the paper's R·E·N; no ALiBi;
[inferred] sharing the store key), ``rmt.norm="layernorm"`` (mean and variance over all E·K
entries, elementwise gain, no bias — the paper has no biases), ``rmt.inverse_layer_scaling=False``
and ``rmt.param="lecun"`` ([inferred] plain LeCun: every kernel N(0, 1/fan_in) including the
embedding (fan_in 1) and the unembedding, no 1/sqrt(2L), no muP multipliers, attention 1/sqrt(E),
plain AdamW with the RMT decay mask).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from icml_jax.models.attention import (NEG_INF, KVCache, attention_mask, causal_attention,
                                       query_block_count)
from icml_jax.models.layers import (constrain, get_dtype, matmul, param, rms_norm, row_sum, upcast,
                                    wide_dtype)
from icml_jax.models.mlp import ACTIVATIONS
from icml_jax.models.positions import alibi_distance
from icml_jax.models.residual import RESIDUALS, OptimizerGroups, Stream, mlp_matrices

X_AXES = ("batch", "length", "act_rmt_value", "act_rmt_key")
HEAD_AXES = ("batch", "length", "act_heads", None)


class RMTState(NamedTuple):
    x: jax.Array  # [B, T, E, K] the residual matrices
    layer: jax.Array  # [B, 1] int32, index of the next layer


# ----------------------------------------------------------------------------- config, scales

def validate(c: ml_collections.ConfigDict) -> None:
    """One-line errors for RMT-specific config mistakes."""
    r = c.rmt
    if c.num_kv_heads != c.num_heads:
        raise ValueError(f"residual='rmt' needs config.model.num_kv_heads == num_heads (got "
                         f"{c.num_kv_heads} vs {c.num_heads}): set num_kv_heads={c.num_heads}")
    for key, val, ok in (("position", r.position, ("alibi", "learned")),
                         ("norm", r.norm, ("rms_matrix", "layernorm")),
                         ("param", r.param, ("mup", "lecun"))):
        if val not in ok:
            raise ValueError(f"unknown config.model.rmt.{key}={val!r}; choose one of {list(ok)}")
    residual_dtype(c)  # a one-line error for an unknown config.model.rmt.residual_dtype
    if r.key_dim <= 0:
        raise ValueError(f"config.model.rmt.key_dim must be positive, got {r.key_dim}")
    if c.get("attention_impl", "einsum") != "einsum":
        raise ValueError(f"residual='rmt' has its own attention; config.model.attention_impl="
                         f"{c.attention_impl!r} would be ignored: leave it at 'einsum'")


def validate_for_training(c: ml_collections.ConfigDict) -> None:
    """``validate`` plus settings a new run must not carry (checked when training starts, not
    when a finished run's model is built for sampling or analysis)."""
    validate(c)
    if c.position not in ("rope", "alibi"):  # rope: the base config's default
        raise ValueError(f"residual='rmt' takes its positions from config.model.rmt.position "
                         f"(alibi|learned), so config.model.position={c.position!r} would be "
                         "ignored: set config.model.position=alibi (or leave the default rope)")


def _fan_in(c) -> dict:
    """Input fan of every hidden kernel (product of its input axes), by param name."""
    R, K, E, F = c.num_heads, c.rmt.key_dim, c.head_dim, c.ffn_dim
    return {"embed_store": R, "qkv_retrieve": K, "attn_store": R, "mlp_retrieve": K, "wi": R * E,
            "wo": F, "mlp_store": R, "unembed_retrieve": K}


def _base_fan_in(c) -> dict:
    """Same with the muP base widths (``rmt.base_*``; 0 = the model's own width)."""
    r = c.rmt
    R = r.base_rank or c.num_heads
    K = r.base_key_dim or r.key_dim
    E = r.base_value_dim or c.head_dim
    F = r.base_ffn_dim or c.ffn_dim
    return {"embed_store": R, "qkv_retrieve": K, "attn_store": R, "mlp_retrieve": K, "wi": R * E,
            "wo": F, "mlp_store": R, "unembed_retrieve": K}


def width_ratios(c) -> dict:
    """muP width ratio fan_in / base_fan_in per hidden kernel; their lr is divided by it."""
    fan, base = _fan_in(c), _base_fan_in(c)
    return {k: fan[k] / base[k] for k in fan}


def hidden_std(c, name: str) -> float:
    fan = _fan_in(c)[name]
    std = (c.init_std if c.rmt.param == "mup" else 1.0) / math.sqrt(fan)
    if name in ("attn_store", "mlp_store") and c.rmt.param == "mup":
        std /= math.sqrt(2 * c.num_layers)  # GPT-2-style residual scaling of the reference
    return std


def output_multiplier(c) -> float:
    """Multiplier of the unembedding: output_multiplier / width_ratio(E·R) (muP), 1 (lecun)."""
    if c.rmt.param != "mup":
        return 1.0
    r = c.rmt
    ratio = (c.num_heads * c.head_dim) / ((r.base_rank or c.num_heads) * (r.base_value_dim or c.head_dim))
    return r.output_multiplier / ratio


def attention_scale(c) -> float:
    """attn_multiplier · sqrt(base_E) / E (muP; = 1/sqrt(E) at base = E), 1/sqrt(E) (lecun)."""
    E = c.head_dim
    if c.rmt.param != "mup":
        return E ** -0.5
    return c.rmt.attn_multiplier * math.sqrt(c.rmt.base_value_dim or E) / E


def alibi_slopes(R: int, dtype=np.float32) -> np.ndarray:
    """m_r = 2^(-8(r+1)/R), r = 0..R-1, [R] in ``dtype`` (the reference's geomspace). Equal to
    ``positions.alibi_slopes`` when R is a power of two; other R keep the reference's sequence
    (Press et al.'s interleaving differs). The distance is ``positions.alibi_distance``."""
    return (2.0 ** (-8.0 * np.arange(1, R + 1) / R)).astype(dtype)


def _normal(std: float) -> Callable:
    return nn.initializers.normal(std) if std > 0 else nn.initializers.zeros


def _qkv_init(std: float, zero_query: bool) -> Callable:
    """N(0, std²) for [K, 3, R]; the query slice (C = 0) zero when ``zero_query``."""
    def init(key, shape, dtype=jnp.float32):
        w = std * jax.random.normal(key, shape, jnp.float32)
        if zero_query:
            w = w.at[:, 0].set(0.0)
        return w.astype(dtype)
    return init


# ----------------------------------------------------------------------------- building blocks

class MatrixNorm(nn.Module):
    """Norm over all E·K entries of each token's matrix with an elementwise [E, K] gain.

    ``rms_matrix`` (reference): x / sqrt(mean(x²) + eps) · g; ``layernorm``: (x - mean) /
    sqrt(var + eps) · g. Statistics in (at least) float32; output in ``dtype``."""
    kind: str
    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BTEK):
        g_EK = param(self, "scale", nn.initializers.ones, x_BTEK.shape[-2:], ("rmt_value", "rmt_key"),
                     self.param_dtype)
        # both kinds are ``layers.rms_norm`` over the E·K entries taken as one row (its VJP, no
        # reduce-window passes); layernorm centres the row first
        EK = x_BTEK.shape[-2] * x_BTEK.shape[-1]
        x = x_BTEK.reshape(x_BTEK.shape[:-2] + (EK,))
        if self.kind == "layernorm":
            x = upcast(x)
            x = x - row_sum(x) / EK
        return rms_norm(x, g_EK.reshape(EK), self.eps, jnp.dtype(self.dtype)).reshape(x_BTEK.shape)


def _norm(c, name):
    return MatrixNorm(c.rmt.norm, c.norm_eps, get_dtype(c.dtype),
                      get_dtype(c.param_dtype, "config.model.param_dtype"), name=name)


def _key_param(module, c, name, shape, axes):
    return param(module, name, _normal(hidden_std(c, name)), shape, axes,
                 get_dtype(c.param_dtype, "config.model.param_dtype"))


def retrieve(x_BTEK, a_KR):
    """Retrieval with R keys: [B, T, E, K] x [K, R] -> [B, T, R, E]: one matmul over the B·T·E
    rows of X (``layers.matmul``: no transposed copy of X in the forward or backward pass; the
    weight gradient transposes the R-wide cotangent)."""
    return jnp.swapaxes(matmul(x_BTEK, a_KR.astype(x_BTEK.dtype)), -1, -2)


def store(v_BTRE, s_RK):
    """Storage of R vectors under R keys: [B, T, R, E] x [R, K] -> [B, T, E, K] (sum over R); the
    model adds it to X with ``store_add``."""
    return jnp.einsum("BTRE,RK->BTEK", v_BTRE, s_RK.astype(v_BTRE.dtype))


def residual_dtype(c) -> jnp.dtype:
    """The dtype the residual matrices X are kept in between layers: ``config.model.rmt.residual_dtype``
    ("" = the compute dtype ``config.model.dtype``)."""
    name = c.rmt.get("residual_dtype", "")
    return get_dtype(name, "config.model.rmt.residual_dtype") if name else get_dtype(c.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def store_add(x_BTEK, v_BTRE, s_RK, dtype):
    """X + store(v, s), summed in at least float32 and kept in ``dtype`` (the residual dtype).

    Forward as one elementwise pass (X + Σ_r v_r ⊗ s_r, R unrolled) instead of a dot whose [B, T,
    E, K] output is written and read back by the add: the contraction is only R long, so the step
    is bound by the X-sized memory traffic, not by the multiply-adds (``store`` is the einsum it
    replaces). Backward: dv = dX s^T and ds = v^T dX as dots in at least float32 (dX passes
    through).

    Numerics: in float32 the values and gradients equal X + ``store(v, s)`` to rounding (1e-5;
    the R-term sum runs in another order). With a bfloat16 compute dtype the update is summed in
    float32 and rounded once; the einsum version rounded the product to bfloat16 before the add.
    Under tensor parallelism (R split over ``tensor``) the unrolled sum reads every r, so GSPMD
    gathers v's R heads ([B, T, R, E]) where the einsum all-reduced X-sized partial sums; this
    has not been timed on a real mesh."""
    wide = wide_dtype(jnp.result_type(v_BTRE.dtype, s_RK.dtype))
    v, s = v_BTRE.astype(wide), s_RK.astype(wide)
    upd = v[:, :, 0, :, None] * s[0]
    for r in range(1, s.shape[0]):
        upd = upd + v[:, :, r, :, None] * s[r]
    return (upcast(x_BTEK) + upd).astype(dtype)


def _store_add_fwd(x_BTEK, v_BTRE, s_RK, dtype):
    return store_add(x_BTEK, v_BTRE, s_RK, dtype), (v_BTRE, s_RK, jnp.zeros((), x_BTEK.dtype))


def _store_add_bwd(dtype, res, g_BTEK):
    v_BTRE, s_RK, x_like = res
    R, K = s_RK.shape
    # in the forward's precision (at least float32, whatever the residual's dtype)
    wide = wide_dtype(jnp.result_type(v_BTRE.dtype, s_RK.dtype, g_BTEK.dtype))
    g = g_BTEK.reshape(-1, K).astype(wide)
    # both products keep dX [B·T·E, K] as it is (rows x K); only the R-wide operands are transposed
    dv = jax.lax.dot_general(g, s_RK.astype(wide), (((1,), (1,)), ((), ())))  # [B·T·E, R]
    v_NR = jnp.swapaxes(v_BTRE, -1, -2).reshape(-1, R).astype(wide)
    ds = jax.lax.dot_general(v_NR, g, (((0,), (0,)), ((), ())))
    dv = jnp.swapaxes(dv.reshape(g_BTEK.shape[:-1] + (R,)), -1, -2).astype(v_BTRE.dtype)
    return g_BTEK.astype(x_like.dtype), dv, ds.astype(s_RK.dtype)


store_add.defvjp(_store_add_fwd, _store_add_bwd)


class RMTIO(nn.Module):
    """Embedding via storage, final norm, unembedding via retrieval."""
    cfg: ml_collections.ConfigDict

    def setup(self):
        c = self.cfg
        validate(c)
        R, K, E, V = c.num_heads, c.rmt.key_dim, c.head_dim, c.vocab_size
        pdt = get_dtype(c.param_dtype, "config.model.param_dtype")
        in_std = c.init_std if c.rmt.param == "mup" else 1.0
        self.embedding = param(self, "embedding", _normal(in_std), (V, R, E),
                               ("vocab", "rmt_rank", "rmt_value"), pdt)
        if c.rmt.position == "learned":
            self.pos_embedding = param(self, "pos_embedding", _normal(in_std), (c.max_seq_len, R, E),
                                       (None, "rmt_rank", "rmt_value"), pdt)
        self.embed_store = _key_param(self, c, "embed_store", (R, K), ("rmt_rank", "rmt_key"))
        self.final_norm = _norm(c, "final_norm")
        self.unembed_retrieve = _key_param(self, c, "unembed_retrieve", (K, R), ("rmt_key", "rmt_rank"))
        out_std = 0.0 if c.rmt.param == "mup" else (R * E) ** -0.5
        self.unembed_REV = param(self, "unembed", _normal(out_std), (R, E, V),
                             ("rmt_rank", "rmt_value", "vocab"), pdt)

    def __call__(self, tokens_BT, positions_BT=None) -> RMTState:
        """tokens [B, T] -> state with X [B, T, E, K]. Learned positions use ``positions_BT``
        (per-document positions from the decoder; the slot index when called without them)."""
        c = self.cfg
        dt = get_dtype(c.dtype)
        B, T = tokens_BT.shape
        e_BTRE = jnp.take(self.embedding, tokens_BT, axis=0).astype(dt)
        if c.rmt.param == "mup":
            e_BTRE = e_BTRE * c.rmt.input_multiplier
        if c.rmt.position == "learned":
            if positions_BT is None:
                positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
            p_BTRE = jnp.take(self.pos_embedding, positions_BT, axis=0).astype(dt)
            e_BTRE = e_BTRE + p_BTRE * (c.rmt.input_multiplier if c.rmt.param == "mup" else 1.0)
        rdt = residual_dtype(c)
        x0_BTEK = jnp.zeros((B, T, c.head_dim, c.rmt.key_dim), rdt)  # storage into an empty memory
        x_BTEK = constrain(store_add(x0_BTEK, e_BTRE, self.embed_store, rdt), X_AXES)
        return RMTState(x_BTEK, jnp.zeros((B, 1), jnp.int32))

    def features(self, h: RMTState):
        """The R unembedding retrievals of the normed residual, flattened: [B, T, R*Dv]."""
        u_BTRE = retrieve(self.final_norm(h.x), self.unembed_retrieve)
        return u_BTRE.reshape(u_BTRE.shape[:2] + (-1,))

    def unembed(self, h: RMTState):
        """Final norm -> R retrievals -> logits float32 [B, T, V]."""
        u_BTRE = retrieve(self.final_norm(h.x), self.unembed_retrieve)
        B, T, R, E = u_BTRE.shape
        u_BTD = u_BTRE.reshape(B, T, R * E)
        # [R·E, V]: R and E are unsharded under our rules (vocab takes `tensor`); a rule sharding E
        # would make this reshape gather the weight
        w_DV = self.unembed_REV.astype(u_BTD.dtype).reshape(R * E, -1)
        if u_BTD.dtype == wide_dtype(u_BTD.dtype):  # float32: ``matmul``'s backward transposes
            logits = matmul(u_BTD, w_DV)  # u, not the V-wide cotangent
        else:  # a low-precision model: logits accumulated and returned in float32
            logits = jnp.einsum("BTD,DV->BTV", u_BTD, w_DV, preferred_element_type=wide_dtype(u_BTD.dtype))
        logits = upcast(logits) * output_multiplier(self.cfg)
        return constrain(logits, ("batch", "length", "act_vocab"))


class RMTAttention(nn.Module):
    """R single-head attentions whose q, k, v are retrievals from the normed residual."""
    cfg: ml_collections.ConfigDict
    decode: bool = False

    @nn.compact
    def __call__(self, x_BTEK, layer_B1, positions_BT, segment_ids_BT):
        """Normed residual [B, T, E, K] -> head outputs o [B, T, R, E] (compute dtype)."""
        c = self.cfg
        R, K = c.num_heads, c.rmt.key_dim
        pdt = get_dtype(c.param_dtype, "config.model.param_dtype")
        w_KCR = param(self, "qkv_retrieve",
                      _qkv_init(hidden_std(c, "qkv_retrieve"), c.rmt.query_zero_init),
                      (K, 3, R), ("rmt_key", None, "rmt_rank"), pdt)
        qkv_BTECR = matmul(x_BTEK, w_KCR.astype(x_BTEK.dtype))
        q, k, v = (constrain(jnp.moveaxis(qkv_BTECR[:, :, :, i], -1, 2), HEAD_AXES) for i in range(3))
        if self.decode:
            k, v, k_pos, k_seg, q_idx, k_idx = KVCache(name="kv_cache")(k, v, positions_BT, segment_ids_BT)
        else:
            k_pos, k_seg = positions_BT, segment_ids_BT
            q_idx = k_idx = jnp.broadcast_to(jnp.arange(x_BTEK.shape[1]), positions_BT.shape)
        mask_BTS = attention_mask(segment_ids_BT, k_seg, q_idx, k_idx)
        return self.attend(q, k, v, mask_BTS, layer_B1, positions_BT, k_pos).astype(x_BTEK.dtype)

    def attend(self, q_BTRE, k_BSRE, v_BSRE, mask_BTS, layer_B1, q_pos_BT, k_pos_BS):
        """float32 softmax attention: z = (q·k)·scale / (ℓ+1) - m_r (t_pos - s_pos); without a
        cache in causal query blocks (``config.model.attention_block``, as the transformer)."""
        c = self.cfg
        B, T, R, E = q_BTRE.shape
        q, k, v = upcast(q_BTRE), upcast(k_BSRE), upcast(v_BSRE)
        dt = q.dtype  # float32, or float64 for a float64 model
        scale = jnp.full((B,), attention_scale(c), dt)  # per row: scale / (layer + 1)
        if c.rmt.inverse_layer_scaling:
            scale = scale / (layer_B1[:, 0] + 1).astype(dt)
        bias = None  # [B, R, 1, T, S]: the R heads as the core's KV-head axis, one query each
        if c.rmt.position == "alibi":
            m_R = jnp.asarray(alibi_slopes(R, dt))
            bias = -m_R[None, :, None, None, None] * alibi_distance(q_pos_BT, k_pos_BS, dt)[:, None, None]
        hi = jax.lax.Precision.HIGHEST
        if self.decode:  # queries against the cache
            z_BRTS = jnp.einsum("BTRE,BSRE->BRTS", q, k, precision=hi) * scale[:, None, None, None]
            if bias is not None:
                z_BRTS = z_BRTS + bias[:, :, 0]
            p_BRTS = jax.nn.softmax(jnp.where(mask_BTS[:, None], z_BRTS, NEG_INF), axis=-1)
            return jnp.einsum("BRTS,BSRE->BTRE", p_BRTS, v, precision=hi)
        # without a cache: the transformer's causal core
        o = causal_attention(q[:, :, :, None], k, v, mask_BTS, bias,
                             query_block_count(c, T, k.shape[1]), row_scale=scale, precision=hi)
        return o.reshape(B, T, R, E)


class RMTBlock(nn.Module):
    """One layer: X += store(attn(retrievals of norm(X))); X += store(split(mlp(concat(retr.))))."""
    cfg: ml_collections.ConfigDict
    decode: bool = False

    @nn.compact
    def __call__(self, h: RMTState, positions_BT, segment_ids_BT):
        c = self.cfg
        R, K, E = c.num_heads, c.rmt.key_dim, c.head_dim
        x_BTEK = h.x
        o_BTRE = RMTAttention(c, self.decode, name="attn")(_norm(c, "attn_norm")(x_BTEK), h.layer,
                                                           positions_BT, segment_ids_BT)
        s_RK = _key_param(self, c, "attn_store", (R, K), ("rmt_rank", "rmt_key"))
        rdt = residual_dtype(c)
        x_BTEK = constrain(store_add(x_BTEK, o_BTRE, s_RK, rdt), X_AXES)

        a_KR = _key_param(self, c, "mlp_retrieve", (K, R), ("rmt_key", "rmt_rank"))
        u_BTRE = retrieve(_norm(c, "mlp_norm")(x_BTEK), a_KR)
        B, T = u_BTRE.shape[:2]
        u_BTD = constrain(u_BTRE.reshape(B, T, R * E), ("batch", "length", "act_embed"))
        mlp = ACTIVATIONS.get(c.mlp.activation)(c, features=R * E, wi_init=_normal(hidden_std(c, "wi")),
                                                wo_init=_normal(hidden_std(c, "wo")), name="mlp")
        y_BTD, acts_BTF = mlp(u_BTD)
        self.sow("intermediates", "mlp_acts", acts_BTF)
        s_RK = _key_param(self, c, "mlp_store", (R, K), ("rmt_rank", "rmt_key"))
        f_BTRE = y_BTD.reshape(B, T, R, E)
        x_BTEK = constrain(store_add(x_BTEK, f_BTRE, s_RK, rdt), X_AXES)
        return RMTState(x_BTEK, h.layer + 1), None




# ----------------------------------------------------------------------------- optimizer groups

_NO_DECAY = ("embedding", "pos_embedding", "unembed", "scale")


def _leaf_name(path) -> str:
    """The param's own name: the last dict key on its path (skips a box's ``.value``)."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return str(keys[-1]) if keys else ""


def optimizer_groups(c) -> OptimizerGroups:
    """The reference's groups: hidden kernels' lr ÷ width ratio (muP only); decay on hidden
    kernels only (not the embedding, the unembedding or the norm gains)."""
    ratios = width_ratios(c)

    def lr_mult(params):
        return jax.tree_util.tree_map_with_path(lambda p, _: 1.0 / ratios.get(_leaf_name(p), 1.0), params)

    def decay(params):
        return jax.tree_util.tree_map_with_path(lambda p, _: _leaf_name(p) not in _NO_DECAY, params)

    return OptimizerGroups(lr_mult if c.rmt.param == "mup" else None, decay)


# ----------------------------------------------------------------------------- reference weights

def from_reference_weights(weights, model_cfg: ml_collections.ConfigDict) -> dict:
    """Our param tree (in ``config.model.param_dtype``, per-layer ``layer_i``, i.e.
    ``scan_layers=False``) from the
    reference model's weights (bmac3/residual-matrix-transformer @ 1afac0c, a haliax model):
    ``weights`` maps the reference's parameter paths (``.module.embedding.param.weight``,
    ``.module.rmt_stack.stacked.<part>.param.weight`` with the layers stacked on axis 0, ...) to
    arrays in its layout (input axes, then output axes). Layout changes: the embedding
    [V, Dv, R] -> [V, R, E], the unembedding [Dv, R, V] -> [R, E, V], the FFN's W1 [R, Dv, F]
    -> [R·E, F] and W2 [F, R, Dv] -> [F, R·E]; every key/store/norm tensor is taken as is.
    ``tests/models/test_rmt.py`` checks that the logits then equal the reference's."""
    if model_cfg.rmt.position == "learned" or model_cfg.scan_layers:
        raise ValueError("from_reference_weights maps the reference's ALiBi model into per-layer "
                         "params: set config.model.rmt.position='alibi' and scan_layers=False")
    w = dict(weights)
    stack = ".module.rmt_stack.stacked."
    R, E, F = model_cfg.num_heads, model_cfg.head_dim, model_cfg.ffn_dim
    p = {"io": {
        "embedding": np.asarray(w[".module.embedding.param.weight"]).transpose(0, 2, 1),
        "embed_store": w[".module.storage_linear.param.weight"],
        "final_norm": {"scale": w[".module.norm.param.weight"]},
        "unembed_retrieve": w[".module.retrieval_linear.param.weight"],
        "unembed": np.asarray(w[".module.unembedding.param.weight"]).transpose(1, 0, 2),
    }}
    for i in range(model_cfg.num_layers):
        g = lambda name: np.asarray(w[stack + name + ".param.weight"])[i]  # noqa: E731
        p[f"layer_{i}"] = {
            "attn_norm": {"scale": g("attention.module.norm")},
            "attn": {"qkv_retrieve": g("attention.module.qkv_linear")},
            "attn_store": g("attention.module.out_linear"),
            "mlp_norm": {"scale": g("mlp.module.norm")},
            "mlp_retrieve": g("mlp.module.retrieval_linear"),
            "mlp": {"wi": g("mlp.module.W1").transpose(1, 0, 2).reshape(R * E, F),
                    "wo": g("mlp.module.W2").transpose(0, 2, 1).reshape(F, R * E)},
            "mlp_store": g("mlp.module.storage_linear"),
        }
    return jax.tree.map(lambda x: jnp.asarray(x, get_dtype(model_cfg.param_dtype,
                                                          "config.model.param_dtype")), p)

# ----------------------------------------------------------------------------- accounting
# (conventions: icml_jax.analysis.flops)

def _dims(m):
    return m.num_layers, m.num_heads, m.rmt.key_dim, m.head_dim, m.ffn_dim, m.vocab_size


def rmt_param_count(m: ml_collections.ConfigDict) -> int:
    """Exact number of parameters of the RMT:
    L(6R·Dk + m·R·Dv·F + 2Dv·Dk) + 2R·Dk + Dv·Dk + 2R·Dv·V (+ N·R·Dv for learned positions),
    with m = 2 (plain MLP) or 3 (gated). With a plain MLP this is the paper's
    R(2Dk(3L+1) + Dv(2L·D_FF + V)) plus the untied unembedding R·V·Dv plus the norm gains
    (2L+1)·Dk·Dv, without its R·Dv·N position term (the default ALiBi has none)."""
    L, R, K, E, F, V = _dims(m)
    layer = 6 * R * K + mlp_matrices(m) * R * E * F + 2 * E * K
    io = 2 * R * K + E * K + 2 * R * E * V
    pos = m.max_seq_len * R * E if m.rmt.position == "learned" else 0
    return L * layer + io + pos


def rmt_matmul_flops_per_token(m: ml_collections.ConfigDict) -> int:
    """Forward matmul FLOPs per token outside attention's QK^T / PV (exact convention):
    storage/retrieval 2R·Dk·Dv each (embedding store, 3 q/k/v retrievals, attention store, FFN
    retrieval and store per layer, final retrieval), the MLP 2m·R·Dv·F, the unembedding 2R·Dv·V."""
    L, R, K, E, F, V = _dims(m)
    keys = (2 + 6 * L) * 2 * R * K * E
    return keys + L * 2 * mlp_matrices(m) * R * E * F + 2 * R * E * V


def rmt_train_flops_per_token(m: ml_collections.ConfigDict, seq_len: int) -> float:
    """Exact convention: 3 x (matmuls + causal-halved QK^T and PV: 2·2·T·Dv per head / 2)."""
    attn = 3.0 * 2 * 2 * m.num_layers * m.num_heads * m.head_dim * seq_len * 0.5
    return 3.0 * rmt_matmul_flops_per_token(m) + attn


def rmt_paper_forward_flops(N: int, L: int, R: int, Dk: int, Dv: int, D_FF: int, V: int,
                            vocab_term: str = "RV") -> float:
    """RMT paper Table 7, forward FLOPs per sequence of N tokens (``vocab_term``: RV | RVDv)."""
    if vocab_term not in ("RV", "RVDv"):
        raise ValueError(f"unknown vocab_term {vocab_term!r}; choose RV (reproduces the paper's "
                         "totals) or RVDv (the formula as printed)")
    X = V if vocab_term == "RV" else V * Dv
    return 6.0 * N * R * Dk * Dv * (1 + L) + N * R * (4.0 * X + L * (4.0 * N * Dv + 3 * N + 4.0 * Dv * D_FF))


def _paper_forward_flops(m: ml_collections.ConfigDict, seq_len: int, vocab_term: str = "RV") -> float:
    L, R, K, E, F, V = _dims(m)
    return rmt_paper_forward_flops(seq_len, L, R, K, E, F, V, vocab_term)


RESIDUALS.register("rmt")(Stream(
    RMTIO, RMTBlock, param_count=rmt_param_count, train_flops_per_token=rmt_train_flops_per_token,
    paper_forward_flops=_paper_forward_flops, optimizer_groups=optimizer_groups,
    validate=validate_for_training,
    reads_position=False))
