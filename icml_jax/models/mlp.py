"""Feed-forward blocks, chosen by `config.model.mlp.activation`.

An MLP maps x [B, T, D] -> (y [B, T, D], acts [B, T, F]) where ``acts`` are the per-neuron
activations that multiply W_down (the gated product for GLU variants), exposed for sparsity
analysis; returning them does not change the forward numerics.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from icml_jax.models.layers import constrain, get_dtype, param
from icml_jax.registry import Registry

ACTIVATIONS = Registry("MLP activation", "config.model.mlp.activation")


@ACTIVATIONS.register("swiglu")
class GatedMLP(nn.Module):
    """GLU MLP with one fused gate/up matmul ([D, 2, F]) and a down projection."""
    cfg: ml_collections.ConfigDict
    gate_fn = staticmethod(jax.nn.silu)

    @nn.compact
    def __call__(self, x_BTD):
        c = self.cfg
        dt, pdt = get_dtype(c.dtype), get_dtype(c.param_dtype, "config.model.param_dtype")
        init = nn.initializers.normal(c.init_std)
        w_D2F = param(self, "wi", init, (c.d_model, 2, c.ffn_dim), ("embed", None, "mlp"), pdt)
        w_FD = param(self, "wo", init, (c.ffn_dim, c.d_model), ("mlp", "embed"), pdt)
        h_BT2F = jnp.einsum("BTD,DCF->BTCF", x_BTD.astype(dt), w_D2F.astype(dt))
        acts_BTF = self.gate_fn(h_BT2F[:, :, 0]) * h_BT2F[:, :, 1]
        acts_BTF = constrain(acts_BTF, ("batch", "length", "act_mlp"))
        y_BTD = jnp.einsum("BTF,FD->BTD", acts_BTF, w_FD.astype(dt))
        return y_BTD, acts_BTF
