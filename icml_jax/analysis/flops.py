"""Parameter and FLOP accounting for the decoder's residual streams (standard and RMT).

Two conventions, stated once:

* **exact** (the default of ``train_flops_per_token``; MaxText's; the trainer's
  ``model_tflops_per_sec``): a matmul of [m, k] x [k, n] costs 2·m·k·n FLOPs; training costs 3x
  the forward (forward + 2x backward); causal attention (QK^T and PV) is counted as half of the
  full T x T product; norms, softmax, rotary, embedding lookups and the optimizer are not
  counted. For the RMT the storage / retrieval contractions are matmuls like any other
  (``tests/analysis`` checks both streams against the traced model's dot_generals).
* **paper** (``convention="paper"``, ``paper_train_flops``): the formulas of the RMT paper
  (Mak & Flanigan 2025, Table 7; ``docs/methods/rmt.md``), N = sequence length, per sequence:
    RMT forward         6N·R·Dk·Dv(1+L) + N·R(4·X + L(4N·Dv + 3N + 4Dv·D_FF)),
                        X = V (``vocab_term="RV"``, the default, reproduces the paper's totals)
                        or V·Dv (``"RVDv"``, the formula as printed);
    transformer forward 4N(V + L·D(2D_h·H + D_FF) + L(N·D_h·H + 3/4·N·H));
    training = 3 x forward x number of sequences. Full (non-causal) attention, softmax counted.
  With them the paper's totals are reproduced to < 1% (transformer 405M 1.18e19 at 6.04e9
  tokens, RMT 305M 8.45e18 at 6.04e9 and 4.97e18 at 3.55e9; ``tests/analysis/test_flops.py``).
  The paper's transformer formula assumes multi-head attention and a two-matrix MLP; here it is
  evaluated with D = d_model, H = num_heads, D_h = head_dim, D_FF = ffn_dim whatever the MLP.

Parameter counts are exact (they equal the initialised param trees, norm gains included).

The formulas live on the residual streams' registry entries (``icml_jax.models.residual.Stream``:
``standard`` in ``models/residual.py``, ``rmt`` in ``models/rmt.py``); this module dispatches and
holds the paper's parameter-count formulas.
"""
import ml_collections

from icml_jax.models.residual import RESIDUALS, matmul_params  # noqa: F401  (re-exported)
from icml_jax.models.rmt import rmt_matmul_flops_per_token  # noqa: F401  (re-exported)


def param_count(m: ml_collections.ConfigDict) -> int:
    """Exact number of parameters of ``Decoder(m)`` (the residual stream's ``param_count``)."""
    return RESIDUALS.get(m.residual).param_count(m)


def train_flops_per_token(m: ml_collections.ConfigDict, seq_len: int,
                          convention: str = "exact", *, vocab_term: str = "RV") -> float:
    """Training FLOPs per token at context length ``seq_len``.

    ``convention``: ``exact`` (causal attention counted as half; see the module docstring) or
    ``paper`` (the RMT paper's Table 7 formulas, per token = per sequence / N; ``vocab_term``
    picks the RMT vocabulary term, module docstring)."""
    if convention == "paper":
        return 3.0 * paper_forward_flops_per_sequence(m, seq_len, vocab_term=vocab_term) / seq_len
    if convention != "exact":
        raise ValueError(f"unknown FLOP convention {convention!r}; choose 'exact' or 'paper'")
    return RESIDUALS.get(m.residual).train_flops_per_token(m, seq_len)


def paper_forward_flops_per_sequence(m: ml_collections.ConfigDict, seq_len: int, *,
                                     vocab_term: str = "RV") -> float:
    """The paper's forward FLOPs per sequence for ``m`` (the residual stream's formula)."""
    return RESIDUALS.get(m.residual).paper_forward_flops(m, seq_len, vocab_term)


def paper_train_flops(m: ml_collections.ConfigDict, seq_len: int, tokens: float, *,
                      vocab_term: str = "RV") -> float:
    """Paper-style training FLOPs total: 3 x forward per sequence x (tokens / seq_len) sequences."""
    return 3.0 * paper_forward_flops_per_sequence(m, seq_len, vocab_term=vocab_term) * tokens / seq_len


def transformer_paper_param_count(L: int, D: int, H: int, D_h: int, D_FF: int, V: int) -> int:
    """RMT paper Table 7 transformer parameters D(L(4H·D_h + 2D_FF) + V) (no unembedding, no norms)."""
    return D * (L * (4 * H * D_h + 2 * D_FF) + V)


def rmt_paper_param_count(L: int, R: int, Dk: int, Dv: int, D_FF: int, V: int, N: int) -> int:
    """RMT paper Table 7 parameters R(2Dk(3L+1) + Dv(2L·D_FF + V + N)) (no unembedding, no norms)."""
    return R * (2 * Dk * (3 * L + 1) + Dv * (2 * L * D_FF + V + N))
