"""Next-token LMs trained with NLL or the precision-recall loss (docs/methods/precision_recall.md).

Run (any JSONL corpus, one string per row; the experiment writes one from a synthetic source):
  python -m icml_jax.main --config=configs/precision_recall.py:default --workdir=runs/pr_nll \
      --config.data.path=corpus.jsonl
  ... --config.loss.type=pr_hinge --config.loss.pr_lambda=0.1 --config.loss.pr_mix_nll=0.1
The experiment (NLL + temperature vs PR losses, exact precision/recall on a Zipf source of random
strings, or on a Markov mixture with its ``markov`` preset):
  python -m experiments.precision_recall --workdir=runs/pr [--preset=tiny|default|markov]

``config.loss``:
  type        nll | pr_hinge  (pr_hinge = the spec's candidate L_lambda = min(lambda,1) - min(lambda, q_y);
                               the paper's exact loss is unverified)
  pr_lambda   lambda > 0 (1.0); < 1 is recall-oriented
  pr_mix_nll  weight of an added NLL term (0.0; pr_hinge only)

Presets: ``tiny`` (tests), ``default`` (2 layers, d=64: short strings need no more).
"""
from icml_jax.config_utils import sibling_config

lm = sibling_config(__file__)

LOSS = dict(type="nll", pr_lambda=1.0, pr_mix_nll=0.0)

PRESETS = {
    "tiny": dict(
        model=dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64,
                   max_seq_len=64),
        data=dict(seq_len=32),
        train=dict(steps=60, batch_size=16, lr=1e-2, warmup_steps=5, log_every=10, eval_every=60,
                   eval_batches=2, checkpoint_every=60, progress=False, async_checkpoint=False),
    ),
    "default": dict(
        model=dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, ffn_dim=256,
                   max_seq_len=64),
        data=dict(seq_len=64),
        train=dict(steps=1500, batch_size=32, lr=3e-3, warmup_steps=100, weight_decay=0.0,
                   log_every=50, eval_every=500, eval_batches=8, checkpoint_every=500,
                   progress=False),
    ),
}


def get_config(preset: str = "default"):
    """``configs/lm.py``'s base with task="pr_lm", JSONL data and ``config.loss``."""
    return lm.preset_config(
        PRESETS, preset, default="default", where="configs/precision_recall.py",
        sections={"loss": LOSS},
        base={"task": "pr_lm", "data": {"name": "jsonl"}, "train": {"samples": 0}})
