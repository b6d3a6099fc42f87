"""Feed-forward blocks, chosen by `config.model.mlp.activation`.

Axis letters: B batch, T length, D model width (the MLP's input/output width), F ffn hidden.

An MLP maps x [B, T, D] -> (y [B, T, D], acts [B, T, F]) where ``acts`` are the per-neuron
activations a_j that multiply row j of W_down (the gated product act(gate)*up for GLU variants,
act(W_in x) otherwise), exposed for sparsity analysis; returning them does not change the forward
numerics. When ``intermediates`` is mutable the MLP also sows ``mlp_in`` (its input x [B, T, D]),
``mlp_gate`` (act(gate); the
activation itself for plain MLPs) and, for GLU variants, ``mlp_up`` (x W_up), for analyses that need
them separately.

Registered activations (``docs/methods/sparsity_cett.md``; the Sparsing Law paper compares the first
two at identical settings):
  ``swiglu``    silu(x W_gate) * (x W_up)           gated   (Llama; HF-exportable)
  ``relu_glu``  relu(x W_gate) * (x W_up)           gated   (ReLU-GLU, the sparse-activation LLM FFN)
  ``relu``      relu(x W_in)                        plain
  ``relu2``     relu(x W_in)^2                      plain   (squared ReLU)
  ``gelu``      gelu(x W_in), exact erf form        plain   (HF ``gelu``)
  ``gelu_tanh`` gelu(x W_in), tanh approximation    plain   (GPT-2 / the RMT reference FFN)
Gated kernels are stored fused as ``wi`` [D, 2, F] (gate, then up); plain ones as ``wi`` [D, F];
the down projection is ``wo`` [F, D]. No biases.

Sparse inference. When the ``sparsity`` variable collection is passed to ``apply`` (see
``icml_jax.analysis.sparsity``) each MLP zeroes neurons before W_down:
  ``threshold``       t (float32 scalar, per layer): neuron j is zeroed iff |a_j| < t / ||W_down[j]||
                      (the reference's CETT rule; ``config.model.mlp.sparse_compare="le"`` uses <=);
  ``gate_threshold``  e (scalar or broadcastable to [B, T, 1]): zeroed iff |act(gate_j)| < e (the
                      FAT-e baseline; for plain MLPs the gate is the activation itself);
  ``topk_zero``       n (int32 scalar): the top-k baseline as the reference runs it, inside the
                      pass: the n smallest |act(gate)| entries of the whole [B, T, F] tensor are
                      zeroed (ties: lower flat index first), then every entry with |act(gate)| <
                      1e-18; ``token_mask`` (bool [B, T], optional) leaves padding out of the
                      ranking (it is ranked last and never zeroed by the count);
  ``topk_zero_per_token``  n (int32 scalar): the same ranking within each token's F entries.
Variables combine by AND of the keep masks. The MLP then sows ``intermediates/mlp_keep`` (float32
[B, T, F], 1 = kept). With no sparsity variable present the module is the dense MLP, bit for bit.
Under ``scan_layers`` every variable carries a leading [L] axis (``analysis.sparsity`` builds the
trees).

Gathered decode path (``icml_jax.models.sparse_ffn``). When ``config.model.mlp.sparse_capacity``
= C > 0 (static), the MLP is gated, the input is statically [1, 1, D] (one decoded token at batch 1)
and the ``sparsity`` collection also holds the prepared rows ``sparse_ffn.ROW_LEAVES``
(``gate_rows`` / ``up_rows`` [F, D], ``down_norm`` / ``up_norm`` [F]; ``decode.generate`` adds them
with ``sparse_ffn.add_gather_rows`` once per call), the MLP runs ``sparse_ffn.sparse_ffn`` with
capacity C instead: the same ``threshold`` / ``gate_threshold`` rule on only the candidate neurons'
up/down rows, the masked dense computation as fallback when there are more than C candidates. There
``acts`` holds the kept activations (0 for zeroed and never-computed neurons), ``mlp_keep`` /
``mlp_gate`` / ``mlp_up`` are not sown, and ``intermediates/sparse_ffn_stats`` is sown instead
(``{"candidates", "kept", "sparse"}`` scalars; ``sparse`` = the gathered branch ran). When the
tree also holds ``sparse_ffn.PREDICTOR_LEAVES`` the MLP runs ``sparse_ffn.predicted_sparse_ffn``
instead (the predictor's top-C neurons, approximate, no fallback). The prepared
rows are cast to the compute dtype per step (keep param and compute dtype equal for speed). Every other input
(the prefill, batch > 1, the top-k variables, no prepared rows) takes the masked dense computation.
C > 0 on a plain (non-gated) MLP is a ValueError.
"""
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from icml_jax.models import sparse_ffn
from icml_jax.models import hooks, lowrank
from icml_jax.models.layers import constrain, get_dtype, matmul, param
from icml_jax.registry import Registry

ACTIVATIONS = Registry("MLP activation", "config.model.mlp.activation")


SPARSITY_VARIABLES = ("threshold", "gate_threshold", "topk_zero", "topk_zero_per_token")
TINY_GATE = 1e-18  # the reference's zero test after top-k zeroing: |gate| < 1e-18 counts as off


def _rank_keep(abs_BTF, n_zero, per_token, token_mask_BT=None):
    """True where an entry's ascending rank (stable: lower flat index first) is >= n_zero, ranking
    within each token (``per_token``) or over the whole tensor (padding tokens ranked last)."""
    if per_token:
        return jnp.argsort(jnp.argsort(abs_BTF, axis=-1, stable=True), axis=-1, stable=True) >= n_zero
    if token_mask_BT is not None:
        abs_BTF = jnp.where(token_mask_BT[..., None], abs_BTF, jnp.inf)
    flat = abs_BTF.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    ranks = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
    return (ranks >= n_zero).reshape(abs_BTF.shape)


def _keep_mask(module, acts_BTF, gate_BTF, w_FD):
    """Keep mask (bool [B, T, F]) from the ``sparsity`` collection, or None when it is absent."""
    present = [n for n in SPARSITY_VARIABLES if module.has_variable("sparsity", n)]
    if not present:
        return None
    get = lambda n: module.get_variable("sparsity", n)  # noqa: E731
    le = module.cfg.mlp.sparse_compare
    if le not in ("lt", "le"):
        raise ValueError(f"config.model.mlp.sparse_compare={le!r}; choose 'lt' (reference) or 'le'")
    below = (lambda x, t: x <= t) if le == "le" else (lambda x, t: x < t)
    abs_gate = jnp.abs(gate_BTF.astype(jnp.float32))
    keep = jnp.ones(acts_BTF.shape, bool)
    if "threshold" in present:
        t = get("threshold").astype(jnp.float32)
        col_norm_F = jnp.linalg.norm(w_FD.astype(jnp.float32), axis=1)
        keep &= ~below(jnp.abs(acts_BTF.astype(jnp.float32)), t / col_norm_F)
    if "gate_threshold" in present:
        keep &= ~below(abs_gate, get("gate_threshold").astype(jnp.float32))
    for name, per_token in (("topk_zero", False), ("topk_zero_per_token", True)):
        if name in present:
            mask = get("token_mask").astype(bool) if module.has_variable("sparsity", "token_mask") else None
            keep &= _rank_keep(abs_gate, get(name), per_token, mask) & (abs_gate >= TINY_GATE)
    return keep


class _MLPBase(nn.Module):
    """Shared fields: ``features`` overrides the input/output width (0 = config.model.d_model);
    ``wi_init``/``wo_init`` override the normal(config.model.init_std) kernel inits (the RMT's
    muP-style init uses this)."""
    cfg: ml_collections.ConfigDict
    features: int = 0
    wi_init: Optional[Callable] = None
    wo_init: Optional[Callable] = None
    edits: tuple = ()  # this layer's hook edits (models/hooks.py): mlp_hidden
    gated = False

    def kernels(self):
        c = self.cfg
        D = self.features or c.d_model
        pdt = get_dtype(c.param_dtype, "config.model.param_dtype")
        default = nn.initializers.normal(c.init_std)
        if self.gated:
            wi = param(self, "wi", self.wi_init or default, (D, 2, c.ffn_dim), ("embed", None, "mlp"), pdt)
        else:
            wi = param(self, "wi", self.wi_init or default, (D, c.ffn_dim), ("embed", "mlp"), pdt)
        wo = param(self, "wo", self.wo_init or default, (c.ffn_dim, D), ("mlp", "embed"), pdt)
        return wi, wo

    def gate_up_acts(self, x_BTD, wi, extra=None):
        """(act(gate), up or None, a), each [B, T, F] in the compute dtype; ``extra`` [B, T, C, F]
        is added to the pre-activations (the low-rank factors' share, ``models/lowrank.py``)."""
        raise NotImplementedError

    def _gather_capacity(self, x_BTD) -> int:
        """C when this call takes the gathered decode path (see the module docstring), else 0."""
        capacity = int(self.cfg.mlp.sparse_capacity or 0)
        if capacity and not self.gated:
            raise ValueError(f"config.model.mlp.sparse_capacity={capacity} needs a gated MLP "
                             f"(relu_glu or swiglu), not {self.cfg.mlp.activation!r}")
        has = lambda n: self.has_variable("sparsity", n)  # noqa: E731
        ready = (capacity > 0 and x_BTD.shape[:2] == (1, 1) and all(map(has, sparse_ffn.ROW_LEAVES))
                 and not any(has(n) for n in ("topk_zero", "topk_zero_per_token")))
        return capacity if ready else 0

    def _gathered(self, x_BTD, w_FD, capacity: int, dt):
        """(y [1, 1, D], kept acts [1, 1, F]) from ``sparse_ffn.sparse_ffn``; sows its stats."""
        get = lambda n: self.get_variable("sparsity", n)  # noqa: E731
        leaves = {n: get(n) for n in sparse_ffn.ROW_LEAVES}
        leaves["gate_rows"], leaves["up_rows"] = (leaves[n].astype(dt) for n in ("gate_rows", "up_rows"))
        w = sparse_ffn.from_leaves(leaves, w_FD.astype(dt))
        t = get("threshold") if self.has_variable("sparsity", "threshold") else 0.0
        e = (jnp.reshape(get("gate_threshold"), ()) if self.has_variable("sparsity", "gate_threshold")
             else None)
        kw = dict(activation=self.cfg.mlp.activation, capacity=capacity,
                  compare=self.cfg.mlp.sparse_compare, gate_threshold=e, return_stats=True,
                  return_acts=True)
        if all(self.has_variable("sparsity", n) for n in sparse_ffn.PREDICTOR_LEAVES):
            pred = {n: get(n) for n in sparse_ffn.PREDICTOR_LEAVES}
            y_D, acts_F, stats = sparse_ffn.predicted_sparse_ffn(w, x_BTD[0, 0], pred, t, **kw)
        else:
            y_D, acts_F, stats = sparse_ffn.sparse_ffn(w, x_BTD[0, 0], t, **kw)
        self.sow("intermediates", "sparse_ffn_stats", stats)
        return y_D.reshape(x_BTD.shape), acts_F.reshape(1, 1, -1)

    @nn.compact
    def __call__(self, x_BTD):
        dt = get_dtype(self.cfg.dtype)
        wi, w_FD = self.kernels()
        capacity = self._gather_capacity(x_BTD)
        if capacity:
            return self._gathered(x_BTD.astype(dt), w_FD, capacity, dt)
        factors = lowrank.mlp_factors(self, self.cfg, self.features or self.cfg.d_model, self.gated,
                                      get_dtype(self.cfg.param_dtype, "config.model.param_dtype"))
        extra = None if factors is None else lowrank.mlp_in_delta(factors, x_BTD.astype(dt))
        gate_BTF, up_BTF, acts_BTF = self.gate_up_acts(x_BTD.astype(dt), wi.astype(dt), extra)
        acts_BTF = constrain(acts_BTF, ("batch", "length", "act_mlp"))
        if self.is_mutable_collection("intermediates"):  # analysis only (GLU-only studies)
            self.sow("intermediates", "mlp_in", x_BTD)
            self.sow("intermediates", "mlp_gate", gate_BTF)
            if up_BTF is not None:
                self.sow("intermediates", "mlp_up", up_BTF)
        used_BTF = acts_BTF
        keep = _keep_mask(self, acts_BTF, gate_BTF, w_FD)
        if keep is not None:
            self.sow("intermediates", "mlp_keep", keep.astype(jnp.float32))
            used_BTF = jnp.where(keep, acts_BTF, jnp.zeros_like(acts_BTF))
        used_BTF = hooks.point(self, "mlp_hidden", used_BTF, self.edits)
        y_BTD = matmul(used_BTF, w_FD.astype(dt))
        if factors is not None:
            y_BTD = y_BTD + lowrank.mlp_out_delta(factors, used_BTF)
        return y_BTD, acts_BTF


def glu(gate_fn, h_BT2F):
    """act(gate) * up of the fused pre-activations h [..., 2, F] (gate, then up), rematerialised:
    the backward pass recomputes act(gate) from h, its only residual. Autodiff kept act(gate) and
    silu's sigmoid as two more [.., F] buffers per layer; without them the `small` step's XLA
    temporaries fall 454 -> 368 MiB and `20m`'s 698 -> 568 MiB, and the step is no slower (the
    recompute is one elementwise pass; in-process A/B 605 -> 598 ms and 1473 -> 1430 ms). A hand-written
    VJP did not do this: XLA's CSE merged its recomputation with the forward's values."""
    return jax.checkpoint(lambda h: gate_fn(h[..., 0, :]) * h[..., 1, :])(h_BT2F)


def activation(act_fn, h_BTF):
    """act(h), rematerialised like :func:`glu` (h is the only residual)."""
    return jax.checkpoint(act_fn)(h_BTF)


class GatedMLP(_MLPBase):
    """GLU MLP with one fused gate/up matmul ([D, 2, F]) and a down projection."""
    gated = True
    gate_fn = staticmethod(jax.nn.silu)

    def gate_up_acts(self, x_BTD, w_D2F, extra=None):
        h_BT2F = matmul(x_BTD, w_D2F)
        if extra is not None:
            h_BT2F = h_BT2F + extra
        gate_BTF, up_BTF = self.gate_fn(h_BT2F[:, :, 0]), h_BT2F[:, :, 1]
        return gate_BTF, up_BTF, glu(self.gate_fn, h_BT2F)


class PlainMLP(_MLPBase):
    """Two-matrix MLP: a = act(x W_in), y = a W_out."""
    act_fn = staticmethod(jax.nn.relu)

    def gate_up_acts(self, x_BTD, w_DF, extra=None):
        h_BTF = matmul(x_BTD, w_DF)
        a_BTF = activation(self.act_fn, h_BTF if extra is None else h_BTF + extra[:, :, 0])
        return a_BTF, None, a_BTF


def _plain(name, fn):
    cls = type(f"{name.title().replace('_', '')}MLP", (PlainMLP,), {"act_fn": staticmethod(fn)})
    ACTIVATIONS.register(name)(cls)
    return cls


ACTIVATIONS.register("swiglu")(GatedMLP)
ReluGLU = ACTIVATIONS.register("relu_glu")(
    type("ReluGLU", (GatedMLP,), {"gate_fn": staticmethod(jax.nn.relu)}))
ReluMLP = _plain("relu", jax.nn.relu)
Relu2MLP = _plain("relu2", lambda x: jnp.square(jax.nn.relu(x)))
GeluMLP = _plain("gelu", lambda x: jax.nn.gelu(x, approximate=False))
GeluTanhMLP = _plain("gelu_tanh", lambda x: jax.nn.gelu(x, approximate=True))


def is_gated(activation: str) -> bool:
    """True for the GLU variants (the ones with separate gate and up projections)."""
    return bool(ACTIVATIONS.get(activation).gated)
