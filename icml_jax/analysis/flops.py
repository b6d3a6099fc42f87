"""Parameter and FLOP accounting for the standard decoder.

FLOP convention (the one MaxText uses): a matmul of [m, k] x [k, n] costs 2·m·k·n FLOPs; training
costs 3x the forward (forward + 2x backward); causal attention (QK^T and PV) is counted as half
of the full T x T product; norms, softmax, rotary and the optimizer are not counted.
"""
import ml_collections


def _mlp_matrices(m) -> int:
    """3 kernels [D, F] for gated MLPs (gate, up, down), 2 for plain ones."""
    from icml_jax.models.mlp import is_gated
    return 3 if is_gated(m.mlp.activation) else 2


def param_count(m: ml_collections.ConfigDict) -> int:
    """Exact number of parameters of ``Decoder(m)`` with the standard residual stream."""
    D, L, H, G, K, F, V = (m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim,
                           m.ffn_dim, m.vocab_size)
    attn = D * (H + 2 * G) * K + H * K * D
    mlp = _mlp_matrices(m) * D * F
    norms = 2 * D
    io = V * D + D + (0 if m.tie_embeddings else D * V)
    from icml_jax.models.positions import position_param_count  # FoPE coefficients
    return L * (attn + mlp + norms + position_param_count(m)) + io


def matmul_params(m: ml_collections.ConfigDict) -> int:
    """Parameters that take part in a matmul per token (excludes the embedding lookup and norms;
    includes the output projection, tied or not)."""
    D, L, H, G, K, F, V = (m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim,
                           m.ffn_dim, m.vocab_size)
    return L * (D * (H + 2 * G) * K + H * K * D + _mlp_matrices(m) * D * F) + D * V


def train_flops_per_token(m: ml_collections.ConfigDict, seq_len: int) -> float:
    """Training FLOPs per token at context length ``seq_len`` (causal attention counted as half)."""
    dense = 6.0 * matmul_params(m)
    # QK^T and PV: 2 matmuls x 2 FLOPs x T x K per head per token, x3 for training, x0.5 causal.
    attn = 3.0 * 2 * 2 * m.num_layers * m.num_heads * m.head_dim * seq_len * 0.5
    return dense + attn
