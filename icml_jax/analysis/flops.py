"""Parameter and FLOP accounting for the decoder's residual streams (standard and RMT).

Two conventions, stated once:

* **exact** (the default of ``train_flops_per_token``; MaxText's; the trainer's
  ``model_tflops_per_sec``): a matmul of [m, k] x [k, n] costs 2·m·k·n FLOPs; training costs 3x
  the forward (forward + 2x backward); causal attention (QK^T and PV) is counted as half of the
  full T x T product; norms, softmax, rotary, embedding lookups and the optimizer are not
  counted. For the RMT the storage / retrieval contractions are matmuls like any other
  (``tests/analysis`` checks both streams against the traced model's dot_generals).
* **paper** (``convention="paper"``, ``paper_train_flops``): the formulas of the RMT paper
  (Mak & Flanigan 2025, Table 7; spec ``specs/rmt.md`` §2.3), N = sequence length, per sequence:
    RMT forward         6N·R·Dk·Dv(1+L) + N·R(4·X + L(4N·Dv + 3N + 4Dv·D_FF)),
                        X = V (``rmt.flops_vocab_term="RV"``, reproduces the paper's totals) or
                        V·Dv (``"RVDv"``, the formula as printed);
    transformer forward 4N(V + L·D(2D_h·H + D_FF) + L(N·D_h·H + 3/4·N·H));
    training = 3 x forward x number of sequences. Full (non-causal) attention, softmax counted.
  With them the paper's totals are reproduced to < 1% (transformer 405M 1.18e19 at 6.04e9
  tokens, RMT 305M 8.45e18 at 6.04e9 and 4.97e18 at 3.55e9; ``tests/analysis/test_flops.py``).
  The paper's transformer formula assumes multi-head attention and a two-matrix MLP; here it is
  evaluated with D = d_model, H = num_heads, D_h = head_dim, D_FF = ffn_dim whatever the MLP.

Parameter counts are exact (they equal the initialised param trees, norm gains included).
"""
import ml_collections


def _mlp_matrices(m) -> int:
    """3 kernels [D, F] for gated MLPs (gate, up, down), 2 for plain ones."""
    from icml_jax.models.mlp import is_gated
    return 3 if is_gated(m.mlp.activation) else 2


def param_count(m: ml_collections.ConfigDict) -> int:
    """Exact number of parameters of ``Decoder(m)`` (dispatches on ``m.residual``)."""
    if m.residual == "rmt":
        return rmt_param_count(m)
    return standard_param_count(m)


def standard_param_count(m: ml_collections.ConfigDict) -> int:
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


def train_flops_per_token(m: ml_collections.ConfigDict, seq_len: int,
                          convention: str = "exact") -> float:
    """Training FLOPs per token at context length ``seq_len`` (dispatches on ``m.residual``).

    ``convention``: ``exact`` (causal attention counted as half; see the module docstring) or
    ``paper`` (the RMT paper's Table 7 formulas, per token = per sequence / N)."""
    if convention == "paper":
        return 3.0 * paper_forward_flops_per_sequence(m, seq_len) / seq_len
    if convention != "exact":
        raise ValueError(f"unknown FLOP convention {convention!r}; choose 'exact' or 'paper'")
    if m.residual == "rmt":
        return rmt_train_flops_per_token(m, seq_len)
    return standard_train_flops_per_token(m, seq_len)


def standard_train_flops_per_token(m: ml_collections.ConfigDict, seq_len: int) -> float:
    """Exact convention, standard stream."""
    dense = 6.0 * matmul_params(m)
    # QK^T and PV: 2 matmuls x 2 FLOPs x T x K per head per token, x3 for training, x0.5 causal.
    attn = 3.0 * 2 * 2 * m.num_layers * m.num_heads * m.head_dim * seq_len * 0.5
    return dense + attn


# ----------------------------------------------------------------------------- RMT

def _rmt_dims(m):
    return m.num_layers, m.num_heads, m.rmt.key_dim, m.head_dim, m.ffn_dim, m.vocab_size


def rmt_param_count(m: ml_collections.ConfigDict) -> int:
    """Exact number of parameters of the RMT (``icml_jax.models.rmt``):
    L(6R·Dk + m·R·Dv·F + 2Dv·Dk) + 2R·Dk + Dv·Dk + 2R·Dv·V (+ N·R·Dv for learned positions),
    with m = 2 (plain MLP) or 3 (gated). With a plain MLP this is the paper's
    R(2Dk(3L+1) + Dv(2L·D_FF + V)) plus the untied unembedding R·V·Dv plus the norm gains
    (2L+1)·Dk·Dv, without its R·Dv·N position term (the default ALiBi has none)."""
    L, R, K, E, F, V = _rmt_dims(m)
    layer = 6 * R * K + _mlp_matrices(m) * R * E * F + 2 * E * K
    io = 2 * R * K + E * K + 2 * R * E * V
    pos = m.max_seq_len * R * E if m.rmt.position == "learned" else 0
    return L * layer + io + pos


def rmt_matmul_flops_per_token(m: ml_collections.ConfigDict) -> int:
    """Forward matmul FLOPs per token outside attention's QK^T / PV (exact convention):
    storage/retrieval 2R·Dk·Dv each (embedding store, 3 q/k/v retrievals, attention store, FFN
    retrieval and store per layer, final retrieval), the MLP 2m·R·Dv·F, the unembedding 2R·Dv·V."""
    L, R, K, E, F, V = _rmt_dims(m)
    keys = (2 + 6 * L) * 2 * R * K * E
    return keys + L * 2 * _mlp_matrices(m) * R * E * F + 2 * R * E * V


def rmt_train_flops_per_token(m: ml_collections.ConfigDict, seq_len: int) -> float:
    """Exact convention: 3 x (matmuls + causal-halved QK^T and PV: 2·2·T·Dv per head / 2)."""
    attn = 3.0 * 2 * 2 * m.num_layers * m.num_heads * m.head_dim * seq_len * 0.5
    return 3.0 * rmt_matmul_flops_per_token(m) + attn


def rmt_paper_forward_flops(N: int, L: int, R: int, Dk: int, Dv: int, D_FF: int, V: int,
                            vocab_term: str = "RV") -> float:
    """RMT paper Table 7, forward FLOPs per sequence of N tokens (``vocab_term``: RV | RVDv)."""
    if vocab_term not in ("RV", "RVDv"):
        raise ValueError(f"unknown config.model.rmt.flops_vocab_term {vocab_term!r}; choose RV or RVDv")
    X = V if vocab_term == "RV" else V * Dv
    return 6.0 * N * R * Dk * Dv * (1 + L) + N * R * (4.0 * X + L * (4.0 * N * Dv + 3 * N + 4.0 * Dv * D_FF))


def transformer_paper_forward_flops(N: int, L: int, D: int, H: int, D_h: int, D_FF: int, V: int) -> float:
    """RMT paper Table 7, transformer forward FLOPs per sequence of N tokens."""
    return 4.0 * N * (V + L * D * (2 * D_h * H + D_FF) + L * (N * D_h * H + 0.75 * N * H))


def transformer_paper_param_count(L: int, D: int, H: int, D_h: int, D_FF: int, V: int) -> int:
    """RMT paper Table 7 transformer parameters D(L(4H·D_h + 2D_FF) + V) (no unembedding, no norms)."""
    return D * (L * (4 * H * D_h + 2 * D_FF) + V)


def rmt_paper_param_count(L: int, R: int, Dk: int, Dv: int, D_FF: int, V: int, N: int) -> int:
    """RMT paper Table 7 parameters R(2Dk(3L+1) + Dv(2L·D_FF + V + N)) (no unembedding, no norms)."""
    return R * (2 * Dk * (3 * L + 1) + Dv * (2 * L * D_FF + V + N))


def paper_forward_flops_per_sequence(m: ml_collections.ConfigDict, seq_len: int) -> float:
    """The paper's forward FLOPs per sequence for ``m`` (dispatches on ``m.residual``)."""
    if m.residual == "rmt":
        L, R, K, E, F, V = _rmt_dims(m)
        return rmt_paper_forward_flops(seq_len, L, R, K, E, F, V, m.rmt.flops_vocab_term)
    return transformer_paper_forward_flops(seq_len, m.num_layers, m.d_model, m.num_heads, m.head_dim,
                                           m.ffn_dim, m.vocab_size)


def paper_train_flops(m: ml_collections.ConfigDict, seq_len: int, tokens: float) -> float:
    """Paper-style training FLOPs total: 3 x forward per sequence x (tokens / seq_len) sequences."""
    return 3.0 * paper_forward_flops_per_sequence(m, seq_len) * tokens / seq_len
