"""ECON's trainable multi-agent harness as Flax modules (docs/methods/econ.md).

ECON (Yi et al., ICML 2025) coordinates N frozen executor LLMs and a coordinator LLM through
small trainable networks; the LLMs themselves are never trained. The pieces, following the
authors' PyTorch modules (``tmlr-group/ECON``, read for this port):

``BeliefNetwork``  one executor's network. Token ids of the observation -> token embedding +
                   sinusoidal positions -> post-norm transformer blocks -> the last real token's
                   state h -> belief b (Dense, LayerNorm, ReLU, Dense), local Q (the same
                   MLP shape on b), and the action e = (T, p) from two linear heads on b:
                   T = T_min + (T_max - T_min)·σ(w_T·b + c_T), p = p_min + (p_max - p_min)·σ(w_p·b + c_p).
``BeliefNetworks`` N of them (separate parameters, one per executor) over [B, N, L] tokens;
                   ``shared=True`` is the reference's single network applied to every agent.
``BeliefEncoder``  self-attention over the N beliefs, residual + LayerNorm, a 4x ReLU FFN,
                   residual + LayerNorm, mean over agents, a final Dense: the group E [B, Db].
``Mixer``          the QMIX-style mixer conditioned on E: w1 = |hyper_w1(E)| [N, M], b1 = Dense(E),
                   h = ELU(Σ_i Q_i w1_i + b1), w2 = |hyper_w2(E)| [M], b2 = MLP(E),
                   Q_tot = h·w2 + b2. Nonnegative weights and a monotone ELU make Q_tot monotone
                   non-decreasing in every Q_i. It also computes the per-agent features F_i
                   (self-attention over the actions e_i, projected, concatenated with E) and
                   their projection to the commitment-embedding space, which the consistency
                   term compares with the commitment.

Dropout of the reference (0.1) is left out: every forward here is deterministic.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

T_RANGE = (0.1, 2.0)
P_RANGE = (0.1, 0.9)


def bounded_actions(t_logit, p_logit, t_range=T_RANGE, p_range=P_RANGE):
    """(T, p) from the two head pre-activations: each an affine map of a sigmoid into its range,
    so T ∈ [t_range] and p ∈ [p_range] for any finite (or infinite) pre-activation (clipped too:
    in float32 0.1 + 0.8·1 rounds just above 0.9)."""
    t = t_range[0] + (t_range[1] - t_range[0]) * jax.nn.sigmoid(t_logit)
    p = p_range[0] + (p_range[1] - p_range[0]) * jax.nn.sigmoid(p_logit)
    return jnp.clip(t, *t_range), jnp.clip(p, *p_range)


def sinusoidal_positions(length: int, dim: int) -> jax.Array:
    """The Transformer's fixed sin/cos table [length, dim] (dim even)."""
    pos = jnp.arange(length, dtype=jnp.float32)[:, None]
    div = jnp.exp(jnp.arange(0, dim, 2, dtype=jnp.float32) * (-math.log(10000.0) / dim))
    table = jnp.zeros((length, dim), jnp.float32)
    table = table.at[:, 0::2].set(jnp.sin(pos * div))
    return table.at[:, 1::2].set(jnp.cos(pos * div))


class _Block(nn.Module):
    """Post-norm transformer block: x = LN(x + MHA(x)); x = LN(x + FFN(x)), FFN = Dense·ReLU·Dense."""
    dim: int
    heads: int
    ff_dim: int

    @nn.compact
    def __call__(self, x, mask=None):
        a = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.dim,
                                            out_features=self.dim, name="attn")(x, x, mask=mask)
        x = nn.LayerNorm(epsilon=1e-5, name="norm1")(x + a)
        f = nn.Dense(self.dim, name="ff_out")(nn.relu(nn.Dense(self.ff_dim, name="ff_in")(x)))
        return nn.LayerNorm(epsilon=1e-5, name="norm2")(x + f)


def _mlp_ln(x, hidden: int, out: int, name: str, relu_first: bool = False):
    """Dense(hidden) -> LayerNorm -> ReLU -> Dense(out), or with ``relu_first`` the mixer's
    Dense -> ReLU -> LayerNorm -> Dense ordering."""
    h = nn.Dense(hidden, name=f"{name}_0")(x)
    h = nn.LayerNorm(epsilon=1e-5, name=f"{name}_ln")(nn.relu(h)) if relu_first else \
        nn.relu(nn.LayerNorm(epsilon=1e-5, name=f"{name}_ln")(h))
    return nn.Dense(out, name=f"{name}_1")(h)


class BeliefNetwork(nn.Module):
    """One executor's belief network over observation token ids [B, L] (``pad_id`` = padding).

    Returns a dict of ``belief`` [B, Db], ``q`` [B], ``temperature`` [B], ``top_p`` [B],
    ``t_logit`` [B], ``p_logit`` [B]. The summary state is the last non-pad token's (the
    reference's pooling); attention ignores pad keys."""
    vocab_size: int
    hidden_dim: int = 256
    belief_dim: int = 128
    heads: int = 4
    layers: int = 2
    max_len: int = 1024
    pad_id: int = 0
    t_range: tuple = T_RANGE
    p_range: tuple = P_RANGE

    @nn.compact
    def __call__(self, tokens_BL):
        B, L = tokens_BL.shape
        real_BL = tokens_BL != self.pad_id
        x = nn.Embed(self.vocab_size, self.hidden_dim, name="embed")(tokens_BL)
        x = x + sinusoidal_positions(self.max_len, self.hidden_dim)[:L]
        mask = nn.make_attention_mask(jnp.ones_like(real_BL), real_BL)
        for i in range(self.layers):
            x = _Block(self.hidden_dim, self.heads, 4 * self.hidden_dim, name=f"block_{i}")(x, mask)
        last = jnp.maximum(real_BL.sum(-1) - 1, 0)
        h = x[jnp.arange(B), last]
        b = _mlp_ln(h, self.hidden_dim, self.belief_dim, "belief")
        t_logit = nn.Dense(1, name="temp_head")(b)[:, 0]
        p_logit = nn.Dense(1, name="top_p_head")(b)[:, 0]
        t, p = bounded_actions(t_logit, p_logit, self.t_range, self.p_range)
        q = _mlp_ln(b, self.hidden_dim, 1, "q")[:, 0]
        return dict(belief=b, q=q, temperature=t, top_p=p, t_logit=t_logit, p_logit=p_logit)


class BeliefNetworks(nn.Module):
    """N belief networks over tokens [B, N, L]; every output gains an agent axis after the batch
    ([B, N, ...]). ``shared=False``: one parameter set per agent (the paper: each executor has
    its own); ``shared=True``: the reference code's single network for all agents."""
    n_agents: int
    net: dict  # BeliefNetwork's fields (vocab_size, hidden_dim, ...)
    shared: bool = False

    @nn.compact
    def __call__(self, tokens_BNL):
        B, N, L = tokens_BNL.shape
        if N != self.n_agents:
            raise ValueError(f"BeliefNetworks: tokens have {N} agents, the module was built for "
                             f"{self.n_agents}")
        if self.shared:
            out = BeliefNetwork(**self.net, name="net")(tokens_BNL.reshape(B * N, L))
            return jax.tree.map(lambda v: v.reshape((B, N) + v.shape[1:]), out)
        per_agent = nn.vmap(BeliefNetwork, variable_axes={"params": 0}, split_rngs={"params": True},
                            in_axes=1, out_axes=1)
        return per_agent(**self.net, name="nets")(tokens_BNL)


class BeliefEncoder(nn.Module):
    """Group representation E [B, Db] from beliefs [B, N, Db]."""
    belief_dim: int = 128
    heads: int = 4

    @nn.compact
    def __call__(self, beliefs_BND):
        a = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.belief_dim,
                                            out_features=self.belief_dim, name="attn")(
            beliefs_BND, beliefs_BND)
        x = nn.LayerNorm(epsilon=1e-5, name="norm")(beliefs_BND + a)
        f = nn.Dense(self.belief_dim, name="ff_out")(nn.relu(nn.Dense(4 * self.belief_dim, name="ff_in")(x)))
        x = nn.LayerNorm(epsilon=1e-5, name="final_norm")(x + f)
        return nn.Dense(self.belief_dim, name="out_proj")(x.mean(axis=1))


class Mixer(nn.Module):
    """The centralized mixer. Inputs: local Q [B, N], actions e [B, N, 2] = (T_i, p_i), group E
    [B, Db]. Returns ``q_tot`` [B], ``features`` F_i [B, N, F], ``features_sd`` [B, N, C] (F_i
    projected to the commitment-embedding dimension C for the consistency term), and the
    mixing weights ``w1`` [B, N, M], ``w2`` [B, M] (both >= 0).

    Widths follow the reference's effective values (its top-level ``entity_dim`` /
    ``mlp_hidden_size`` lookups miss the config's nested ``arch`` section and fall back to
    64 / 128): mixing width M = 32, F = 64, w_i width F / 2, hypernet hidden 128,
    2 attention heads over the 2-d actions."""
    n_agents: int
    commit_dim: int
    mixing_dim: int = 32
    feature_dim: int = 64
    hyper_hidden: int = 128
    action_heads: int = 2

    @nn.compact
    def __call__(self, q_BN, actions_BN2, group_BD):
        B, N = q_BN.shape
        attn = nn.MultiHeadDotProductAttention(num_heads=self.action_heads, qkv_features=2, out_features=2,
                                               name="action_attn")(actions_BN2, actions_BN2)
        w = nn.Dense(self.feature_dim // 2, name="w_proj")(attn)
        e_rep = jnp.broadcast_to(group_BD[:, None], (B, N, group_BD.shape[-1]))
        feats = nn.LayerNorm(epsilon=1e-5, name="feat_norm")(
            nn.relu(nn.Dense(self.feature_dim, name="feat")(jnp.concatenate([w, e_rep], -1))))
        feats_sd = nn.Dense(self.commit_dim, name="feat_to_commit")(feats)

        M = self.mixing_dim
        w1 = jnp.abs(_mlp_ln(group_BD, self.hyper_hidden, N * M, "hyper_w1", relu_first=True)).reshape(B, N, M)
        b1 = nn.Dense(M, name="hyper_b1")(group_BD)
        hidden = jax.nn.elu(jnp.einsum("bn,bnm->bm", q_BN, w1) + b1)
        w2 = jnp.abs(_mlp_ln(group_BD, self.hyper_hidden, M, "hyper_w2", relu_first=True))
        b2 = nn.Dense(1, name="hyper_b2_1")(nn.relu(nn.Dense(self.hyper_hidden // 2, name="hyper_b2_0")(group_BD)))
        q_tot = jnp.einsum("bm,bm->b", hidden, w2) + b2[:, 0]
        return dict(q_tot=q_tot, features=feats, features_sd=feats_sd, w1=w1, w2=w2)
