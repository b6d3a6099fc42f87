"""Position embeddings, chosen by `config.model.position`: ``rope``, ``fope``, ``alibi``, ``nope``.

A position module is built once per attention layer (so it may own per-layer params) and has two
methods, both optional to override (see ``PositionEmbedding``):
  ``q, k = pos(q_BTGRK, k_BSGK, q_pos_BT, k_pos_BS)``   rotate/transform queries and keys;
  ``bias = pos.bias(q_pos_BT, k_pos_BS)``               an additive float32 logit bias that
                                                         broadcasts to [B, G, R, T, S], or None.
Positions are per token, so packed rows (positions restarting per document) and decoding at an
offset (keys come from the KV cache with their own positions) need nothing special.

Axis letters: B batch, T query length, S key length, G kv heads, R query heads per kv head
(query head h = g*R + r), K head dim, N table length (``config.model.max_seq_len``),
I kept FoPE frequencies (D_in), O FoPE series width (D_out).

FoPE (Hua et al., ICML 2025; ``docs/methods/fope.md``) follows the authors' code
(TsinghuaC3I/Fourier-Position-Embedding @ bd94b20, ``olmo/model.py``: ``RotaryEmbedding.get_inv_freq``
and ``FourierEmbedding``), which we read and checked:
  * floor clipping compares the float32 ladder with ``ratio * 2*pi / L`` (``<`` drops), L is the
    training length (their ``max_sequence_length``; ours ``config.model.train_seq_len``, 0 = max_seq_len);
  * only the kept frequencies enter the series; D_out = min(D_in, K // 4) (their ``TODO: //8``);
  * ``sin_coef``/``cos_coef`` [heads, D_in, D_out], ``eye_xavier_norm`` init = torch
    ``xavier_normal_`` on the 3-D tensor (fan_in = D_in*D_out, fan_out = heads*D_out) plus an
    identity, or a "step eye" (1 at (d*ceil(D_in/D_out), d)) when D_in != D_out;
  * ``F.pad(..., value=1)`` on BOTH the sin and the cos series (pad-1 quirk; ``fope.pad_sin_value``
    = 0 gives the corrected, position-free channels), then ``cat((x, x))`` to full width and the
    NeoX half-split ``x*cos + rotate_half(x)*sin`` in float32, for q and k alike;
  * fixed coefficients are ``requires_grad=False`` there and so are skipped by their optimizer
    (no weight decay either); learnable ones are decayed. Here fixed coefficients stay in the param
    tree behind ``stop_gradient`` and ``frozen_param_mask`` tells the optimizer not to touch them.
  * their checkpoint loader (``olmo/checkpoint.py``) grows a coefficient tensor by copying it into
    the top-left block of a fresh xavier + step-eye init (``len_extra_fourier_expand``; without that
    flag the rest stays zero): ``extend_fope_params``.
Difference: the reference only has multi-head attention (one coefficient slice per head, shared by
q and k). With grouped-query attention keys are encoded once per kv head, so here the slices are
per kv head and the R query heads of a group share theirs; with num_kv_heads == num_heads
(as in ``configs/fope.py``) this is exactly the reference.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from icml_jax.models.layers import get_dtype, materialize, param, upcast, wide_dtype
from icml_jax.registry import Registry

POSITIONS = Registry("position embedding", "config.model.position")


def rope_inv_freq(head_dim: int, theta: float, scaling=None, dtype=jnp.float32) -> jnp.ndarray:
    """Inverse frequencies theta^(-2i/K) for i < K/2, [K/2] in ``dtype``, optionally rescaled.

    ``scaling`` is ``config.model.rope_scaling``: ``linear`` divides every frequency by ``factor``;
    ``llama3`` divides the low frequencies (wavelength above original_max_position /
    low_freq_factor) by ``factor``, keeps the high ones (wavelength below original_max_position /
    high_freq_factor) and interpolates smoothly in between (HF's ``rope_type="llama3"``)."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=dtype) / head_dim))
    kind = "none" if scaling is None else scaling.type
    if kind == "none":
        return inv
    if kind == "linear":
        return inv / scaling.factor
    if kind == "llama3":
        lo, hi, old = scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_position
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > old / lo, inv / scaling.factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return jnp.where(medium, smoothed, scaled)
    raise ValueError(f"unknown config.model.rope_scaling.type {kind!r}; choose none, linear or llama3")


def training_length(cfg) -> int:
    """L for floor clipping: ``config.model.train_seq_len``, or ``max_seq_len`` when it is 0."""
    L = int(cfg.train_seq_len or 0)
    return L if L > 0 else int(cfg.max_seq_len)


def floor_clip_mask(inv_freq: np.ndarray, train_len: int, ratio: float = 1.0) -> np.ndarray:
    """Boolean [K/2]: frequencies kept by floor clipping, i.e. not ``w < ratio * 2*pi / L``
    (the period 2*pi/w is at most L / ratio). Compared in float32 as the reference does."""
    floor = np.float32(2 * math.pi / train_len * ratio)
    return ~(np.asarray(inv_freq, np.float32) < floor)


def rotary_tables(pos, inv_freq, dtype):
    """(cos, sin) [B, T, K/2] of the angles pos * inv_freq in ``dtype``, each computed once
    (``layers.materialize``: XLA:CPU otherwise fused the sine and cosine into every fusion that
    reads them, recomputing them per element of q, k and their gradients); inline for one
    position per row (decode steps: tiny tables, and a conditional per layer and step)."""
    ang = pos.astype(dtype)[..., None] * inv_freq
    tables = lambda a: (jnp.cos(a), jnp.sin(a))  # noqa: E731
    return tables(ang) if ang.shape[1] <= 1 else materialize(tables, ang)


def apply_rotary(x, pos, inv_freq, tables=None):
    """Half-split rotation (the layout HF Llama checkpoints use) of x [B, T, ..., K] at pos [B, T]
    (``tables``: :func:`rotary_tables` of pos, if already made).

    Computed in float32 (float64 for a float64 x), returned in x's dtype."""
    cos, sin = tables or rotary_tables(pos, inv_freq, wide_dtype(x.dtype))
    shape = cos.shape[:2] + (1,) * (x.ndim - 3) + cos.shape[-1:]
    return apply_cos_sin(x, cos.reshape(shape), sin.reshape(shape))


def apply_cos_sin(x, cos, sin):
    """x' = x*[cos; cos] + rotate_half(x)*[sin; sin] with rotate_half([x1; x2]) = [-x2; x1].

    ``cos``/``sin`` [..., K/2] broadcast against x [..., K]; float32 (float64 for a float64 x)
    inside, x's dtype out."""
    x32 = upcast(x)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class PositionEmbedding(nn.Module):
    """Base: no rotation, no bias (NoPE). The class methods are what the train loop and the
    parameter counter ask of a position embedding (they take ``config.model``)."""
    cfg: ml_collections.ConfigDict

    @classmethod
    def validate(cls, model_cfg) -> None:
        """Raises ValueError, naming the config key, for a config this embedding cannot run."""

    @classmethod
    def frozen_leaf_names(cls, model_cfg) -> tuple:
        """Names of this module's params the optimizer must never change."""
        return ()

    @classmethod
    def layer_param_count(cls, model_cfg) -> int:
        """Parameters one attention layer's position module owns."""
        return 0

    def __call__(self, q, k, q_pos, k_pos):
        return q, k

    def bias(self, q_pos, k_pos):
        return None


@POSITIONS.register("rope")
class RoPE(PositionEmbedding):
    """Rotary embedding; ``config.model.rope_floor_clip`` zeroes the frequencies whose period is
    longer than the training length / ``rope_floor_ratio`` (FoPE's clipping, applied to RoPE)."""

    @classmethod
    def validate(cls, model_cfg) -> None:
        if model_cfg.head_dim % 2:
            raise ValueError(f"config.model.head_dim={model_cfg.head_dim} is odd: RoPE rotates pairs "
                             "of channels; use an even head_dim")

    def inv_freq(self, head_dim: int):
        dt = wide_dtype(get_dtype(self.cfg.dtype))  # float64 models: float64
        inv = rope_inv_freq(head_dim, self.cfg.rope_theta, self.cfg.rope_scaling, dt)
        if self.cfg.rope_floor_clip:
            floor = np.float32(2 * math.pi / training_length(self.cfg)
                               * self.cfg.rope_floor_ratio)
            inv = jnp.where(inv < floor, 0.0, inv)  # traced under jit: compare in jnp
        return inv

    def __call__(self, q, k, q_pos, k_pos):
        inv_freq = self.inv_freq(q.shape[-1])
        tables = rotary_tables(q_pos, inv_freq, wide_dtype(q.dtype)) if q_pos is k_pos else None
        return apply_rotary(q, q_pos, inv_freq, tables), apply_rotary(k, k_pos, inv_freq, tables)


POSITIONS.register("nope")(PositionEmbedding)


# ----------------------------------------------------------------------------- FoPE

def fope_frequencies(head_dim: int, theta: float, train_len: int, floor_ratio: float = 1.0,
                     dout_divisor: int = 4):
    """(Omega float32 [D_in], D_in, D_out): the kept RoPE frequencies (original, decreasing order).

    Raises ValueError when the training length keeps no frequency."""
    with jax.ensure_compile_time_eval():  # concrete even inside jit; XLA's pow = torch's bits
        inv = np.asarray(rope_inv_freq(head_dim, theta), np.float32)
    omega = inv[floor_clip_mask(inv, train_len, floor_ratio)]
    d_in = int(omega.size)
    if d_in == 0:
        raise ValueError(
            f"FoPE: training length {train_len} (config.model.train_seq_len, 0 = max_seq_len) with "
            f"rope_floor_ratio={floor_ratio} keeps no frequency of head_dim={head_dim}, "
            f"theta={theta}: every period is longer than {train_len / floor_ratio:g} tokens. The "
            f"highest frequency has period 2*pi ~ 6.3 tokens; raise the training length.")
    d_out = min(d_in, head_dim // dout_divisor)
    if d_out == 0:
        raise ValueError(f"FoPE: head_dim={head_dim} // config.model.fope.dout_divisor="
                         f"{dout_divisor} is 0; use a larger head_dim or a smaller divisor")
    return omega, d_in, d_out


def fope_init_std(heads: int, d_in: int, d_out: int, gain: float, mode: str = "xavier") -> float:
    """Std of the random part: torch ``xavier_normal_`` on [heads, D_in, D_out] (fan_in =
    D_in*D_out, fan_out = heads*D_out), i.e. gain*sqrt(2 / (D_out*(D_in + heads))), or the gain
    itself (``mode="gain"``, the paper's "N(0, sigma)" reading)."""
    if mode == "xavier":
        return gain * math.sqrt(2.0 / (d_out * (d_in + heads)))
    if mode == "gain":
        return float(gain)
    raise ValueError(f"unknown config.model.fope.init_std {mode!r}; choose xavier or gain")


def step_eye(d_in: int, d_out: int) -> np.ndarray:
    """[D_in, D_out] float32: identity if square, else 1 at (d*ceil(D_in/D_out), d)."""
    e = np.zeros((d_in, d_out), np.float32)
    step = -(-d_in // d_out)
    for d in range(d_out):
        if d * step < d_in:
            e[d * step, d] = 1.0
    return e


def fope_coef_init(std: float):
    """Flax initializer for a [heads, D_in, D_out] coefficient tensor: N(0, std^2) + step eye."""
    def init(key, shape, dtype=jnp.float32):
        eye = jnp.asarray(step_eye(shape[-2], shape[-1]))
        return (std * jax.random.normal(key, shape, jnp.float32) + eye).astype(dtype)
    return init


def fope_tables(omega_I, sin_coef_GIO, cos_coef_GIO, length: int, head_dim: int,
                pad_sin_value: float = 1.0):
    """Precomputed per-position tables (sin, cos), float32 [N, G, K/2] for positions 0..N-1:
    the Fourier series over the kept frequencies, padded to K/2 channels (sin with
    ``pad_sin_value``, cos with 1)."""
    n = jnp.arange(length, dtype=jnp.float32)[:, None] * jnp.asarray(omega_I)  # [N, I]
    s = jnp.einsum("NI,GIO->NGO", jnp.sin(n), sin_coef_GIO.astype(jnp.float32))
    c = jnp.einsum("NI,GIO->NGO", jnp.cos(n), cos_coef_GIO.astype(jnp.float32))
    pad = [(0, 0), (0, 0), (0, head_dim // 2 - s.shape[-1])]
    return (jnp.pad(s, pad, constant_values=pad_sin_value), jnp.pad(c, pad, constant_values=1.0))


@POSITIONS.register("fope")
class FoPE(PositionEmbedding):
    """Fourier Position Embedding with per-layer, per-(kv-)head sin/cos coefficients.

    Params: ``sin_coef``, ``cos_coef`` float32 [G, D_in, D_out] (fixed by default: they stay in the
    param tree for 1:1 checkpoints, gradients are stopped and ``frozen_param_mask`` keeps the
    optimizer off them; ``config.model.fope.learnable`` trains them). The sin/cos tables for
    positions 0..max_seq_len-1 are computed once per call and gathered per token (positions must
    be < max_seq_len, which the decoder and ``generate`` already enforce)."""

    @classmethod
    def frozen_leaf_names(cls, model_cfg) -> tuple:
        return () if model_cfg.fope.learnable else ("sin_coef", "cos_coef")

    @classmethod
    def layer_param_count(cls, model_cfg) -> int:
        """2 * G * D_in * D_out."""
        c = model_cfg
        _, d_in, d_out = fope_frequencies(c.head_dim, c.rope_theta, training_length(c),
                                          c.rope_floor_ratio, c.fope.dout_divisor)
        return 2 * c.num_kv_heads * d_in * d_out

    def setup(self):
        c, f = self.cfg, self.cfg.fope
        K, G = c.head_dim, c.num_kv_heads
        self.omega, self.d_in, self.d_out = fope_frequencies(
            K, c.rope_theta, training_length(c), c.rope_floor_ratio, f.dout_divisor)
        std = fope_init_std(G, self.d_in, self.d_out, f.init_gain, f.init_std)
        shape, axes = (G, self.d_in, self.d_out), ("kv_heads", None, None)
        self.sin_coef = param(self, "sin_coef", fope_coef_init(std), shape, axes, jnp.float32)
        self.cos_coef = param(self, "cos_coef", fope_coef_init(std), shape, axes, jnp.float32)

    def tables(self):
        """(sin, cos) float32 [N, G, K/2], N = max_seq_len."""
        s, c = self.sin_coef, self.cos_coef
        if not self.cfg.fope.learnable:
            s, c = jax.lax.stop_gradient(s), jax.lax.stop_gradient(c)
        return fope_tables(self.omega, s, c, self.cfg.max_seq_len, self.cfg.head_dim,
                           self.cfg.fope.pad_sin_value)

    def __call__(self, q_BTGRK, k_BSGK, q_pos_BT, k_pos_BS):
        sin_NGC, cos_NGC = self.tables()
        q = apply_cos_sin(q_BTGRK, cos_NGC[q_pos_BT][:, :, :, None], sin_NGC[q_pos_BT][:, :, :, None])
        k = apply_cos_sin(k_BSGK, cos_NGC[k_pos_BS], sin_NGC[k_pos_BS])
        return q, k


def frozen_param_mask(model_cfg, params):
    """Pytree of bools like ``params``: True where the optimizer must not change the leaf
    (fixed FoPE coefficients: no update, no weight decay, as ``requires_grad=False`` in the
    reference); the names come from the position embedding's ``frozen_leaf_names``."""
    names = POSITIONS.get(model_cfg.position).frozen_leaf_names(model_cfg)

    def leaf(path, _):
        return bool(names) and getattr(path[-1], "key", None) in names
    return jax.tree_util.tree_map_with_path(leaf, params)


def extend_fope_params(params, new_model_cfg, key, fresh_init: bool = True):
    """Context extension of a trained FoPE model: every ``sin_coef``/``cos_coef`` [G, I, O] is
    copied into the top-left block of a [G, I', O'] tensor sized for ``new_model_cfg`` (e.g. a
    larger ``train_seq_len`` keeps more frequencies). The rest is a fresh xavier + step-eye init
    (``fresh_init``, the reference's ``len_extra_fourier_expand``) or zeros (its default). A
    smaller target is cut to its top-left block. Other params are returned unchanged."""
    c = new_model_cfg
    _, d_in, d_out = fope_frequencies(c.head_dim, c.rope_theta, training_length(c),
                                      c.rope_floor_ratio, c.fope.dout_divisor)
    std = fope_init_std(c.num_kv_heads, d_in, d_out, c.fope.init_gain, c.fope.init_std)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(key, max(len(leaves), 1))
    out = []
    for (path, x), k in zip(leaves, keys):
        if getattr(path[-1], "key", None) not in ("sin_coef", "cos_coef"):
            out.append(x)
            continue
        shape = (x.shape[0], d_in, d_out)
        new = fope_coef_init(std)(k, shape, x.dtype) if fresh_init else jnp.zeros(shape, x.dtype)
        i, o = min(d_in, x.shape[1]), min(d_out, x.shape[2])
        out.append(new.at[:, :i, :o].set(x[:, :i, :o]))
    return jax.tree_util.tree_unflatten(treedef, out)


# ----------------------------------------------------------------------------- ALiBi

def alibi_slopes(num_heads: int, dtype=np.float32) -> np.ndarray:
    """ALiBi head slopes [H] in ``dtype`` (Press et al. 2022): the geometric sequence 2^(-8i/n),
    i = 1..n, for n = H a power of two; otherwise the slopes of the largest power of two n < H
    followed by every other slope of 2n (odd i) until H slopes are filled."""
    def geometric(n):
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(n)
    if n < num_heads:
        slopes += geometric(2 * n)[0::2][: num_heads - n]
    return np.asarray(slopes, dtype)


@POSITIONS.register("alibi")
class ALiBi(PositionEmbedding):
    """No rotation; logit bias -slope_h * (q_pos - k_pos) (per-document positions, so it is
    correct in packed rows and against the KV cache's key positions)."""

    def bias(self, q_pos_BT, k_pos_BS):
        G, H = self.cfg.num_kv_heads, self.cfg.num_heads
        dt = wide_dtype(get_dtype(self.cfg.dtype))  # float64 models: float64
        slopes_GR = jnp.asarray(alibi_slopes(H, dt).reshape(G, H // G))
        return -slopes_GR[None, :, :, None, None] * alibi_distance(q_pos_BT, k_pos_BS, dt)[:, None, None]


def alibi_distance(q_pos_BT, k_pos_BS, dtype=jnp.float32):
    """q_pos - k_pos as [B, T, S] in ``dtype`` (ALiBi's distance; the RMT uses it too)."""
    return (q_pos_BT[:, :, None] - k_pos_BS[:, None, :]).astype(dtype)


def position_param_count(model_cfg) -> int:
    """Parameters one attention layer's position module owns (FoPE: 2 * G * D_in * D_out)."""
    return POSITIONS.get(model_cfg.position).layer_param_count(model_cfg)
