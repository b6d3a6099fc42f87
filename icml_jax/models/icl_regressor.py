"""A real-valued in-context regressor built from the decoder's own blocks (Fed-ICL's toy model).

``ICLRegressor(cfg)``: a linear read-in of real-valued tokens
to d_model, ``cfg.num_layers`` blocks of the configured residual stream (``models/residual.py``:
the same attention, MLP and norms as ``Decoder``; use ``position="nope"``, the demonstrations are a
set), the final RMSNorm and a linear read-out of the last slot (the query). Causal attention with
the query last lets the query read every demonstration; slots with segment id 0 are padding and
are never attended from the query.

``prompt_tokens`` writes a prompt: demonstration i is (x_i, y_i, 0, 0); the query is
(x_q, ŷ, 1, has_hint), where ŷ is the previous answer (0 when there is none). The module takes the
raw arrays, ``model(X [B,S,d], Y [B,S], mask [B,S], xq [B,d], hint [B], has_hint [B]) -> [B]``,
and writes the prompt itself (``products``: see ``prompt_tokens``).
"""
import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from icml_jax.models.layers import RMSNorm
from icml_jax.models.residual import RESIDUALS


def token_dim(d: int, products: bool = False) -> int:
    """Features per token for inputs of dimension d: x, y, is-query flag, has-hint flag (and y·x)."""
    return d + 3 + (d if products else 0)


def prompt_tokens(X_BSD, Y_BS, mask_BS, xq_BD, hint_B, has_hint_B, products: bool = False):
    """(tokens [B, S + 1, token_dim] float32, segment ids [B, S + 1] int32); empty demonstration
    slots (``mask`` False) get segment 0 and zero features. ``products`` appends y_i·x_i to each
    demonstration and ŷ·x_q to the query (a fixed feature map; see docs/methods/fed_icl.md)."""
    X_BSD, Y_BS, xq_BD = (jnp.asarray(a, jnp.float32) for a in (X_BSD, Y_BS, xq_BD))
    m = jnp.asarray(mask_BS, jnp.float32)
    B, S, _ = X_BSD.shape
    zeros = jnp.zeros((B, S, 2), jnp.float32)
    demos = jnp.concatenate([X_BSD * m[..., None], (Y_BS * m)[..., None], zeros], -1)
    has = jnp.asarray(has_hint_B, jnp.float32)
    query = jnp.concatenate([xq_BD, (jnp.asarray(hint_B, jnp.float32) * has)[:, None],
                             jnp.ones((B, 1)), has[:, None]], -1)
    tokens = jnp.concatenate([demos, query[:, None]], 1)
    if products:
        xs = jnp.concatenate([X_BSD * m[..., None], xq_BD[:, None]], 1)
        ys = jnp.concatenate([Y_BS * m, (jnp.asarray(hint_B, jnp.float32) * has)[:, None]], 1)
        tokens = jnp.concatenate([tokens, xs * ys[..., None]], -1)
    seg = jnp.concatenate([jnp.asarray(mask_BS, jnp.int32), jnp.ones((B, 1), jnp.int32)], 1)
    return tokens, seg


class ICLRegressor(nn.Module):
    cfg: ml_collections.ConfigDict  # a config.model section (frozen)
    products: bool = False

    @nn.compact
    def __call__(self, X_BSD, Y_BS, mask_BS, xq_BD, hint_B, has_hint_B):
        c = self.cfg
        tokens_BTF, segment_ids_BT = prompt_tokens(X_BSD, Y_BS, mask_BS, xq_BD, hint_B, has_hint_B, self.products)
        B, T, _ = tokens_BTF.shape
        if T > c.max_seq_len:
            raise ValueError(f"prompt of {T} slots exceeds config.model.max_seq_len={c.max_seq_len}")
        h = nn.Dense(c.d_model, name="read_in")(tokens_BTF)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        block = RESIDUALS.get(c.residual).Block
        for i in range(c.num_layers):
            h, _ = block(c, False, name=f"layer_{i}")(h, positions, segment_ids_BT)
        h = RMSNorm(eps=c.norm_eps, name="final_norm")(h[:, -1])
        return nn.Dense(1, name="read_out")(h)[:, 0].astype(jnp.float32)


def build_icl_regressor(model_cfg: ml_collections.ConfigDict, products: bool = False) -> ICLRegressor:
    if model_cfg.residual != "standard":
        raise ValueError(f"ICLRegressor needs config.model.residual='standard', got {model_cfg.residual!r}")
    return ICLRegressor(ml_collections.FrozenConfigDict(model_cfg), products)
