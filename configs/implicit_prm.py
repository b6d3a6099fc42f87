"""Implicit process reward models (docs/methods/implicit_prm.md): CE on outcome labels of a
log-ratio reward r = beta * log pi/ref; step rewards come for free at scoring time.

Run (labelled completions in TRL's unpaired JSONL: prompt / completion / label; init_from: the
generator, also the frozen reference):
  python -m icml_jax.main --config=configs/implicit_prm.py:default --workdir=runs/iprm_ce \
      --config.data.path=labelled.jsonl --config.train.init_from=runs/generator
The DPO variant is the preference task on (correct, incorrect) pairs of one problem:
  python -m icml_jax.main --config=configs/dpo.py:default --workdir=runs/iprm_dpo \
      --config.data.path=pairs.jsonl --config.train.init_from=runs/generator --config.loss.beta=0.05
The experiment (arithmetic testbed, best-of-N, first-error detection):
  python -m experiments.implicit_prm --workdir=runs/implicit_prm [--preset=tiny|default]

``config.loss``: beta (0.05, the reference's run scripts), bce_log_clamp (-100, torch BCELoss;
0 = exact log-sigmoid), reference ("" = config.train.init_from).
"""
import ml_collections

from icml_jax.config_utils import sibling_config

lm = sibling_config(__file__)

LOSS = dict(beta=0.05, bce_log_clamp=-100.0, reference="")

PRESETS = {
    "tiny": dict(
        # configs/lm.py:tiny's model, so that an lm.py:tiny run is the generator
        model=dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64,
                   max_seq_len=128),
        data=dict(seq_len=64),
        train=dict(steps=20, batch_size=8, lr=1e-3, warmup_steps=2, log_every=5, eval_every=10,
                   eval_batches=2, checkpoint_every=10, progress=False, async_checkpoint=False),
    ),
    "default": dict(
        model=dict(d_model=128, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32, ffn_dim=384,
                   max_seq_len=256),
        data=dict(seq_len=160),
        train=dict(steps=300, batch_size=16, lr=1e-4, warmup_steps=15, min_lr_ratio=0.0,
                   weight_decay=0.0, log_every=10, eval_every=100, eval_batches=8,
                   checkpoint_every=100, progress=True),
    ),
}


def get_config(preset: str = "default") -> ml_collections.ConfigDict:
    """``configs/lm.py``'s base with task="implicit_prm", unpaired data and ``config.loss``."""
    return lm.preset_config(
        PRESETS, preset, default="default", where="configs/implicit_prm.py", sections={"loss": LOSS},
        base={"task": "implicit_prm", "data": {"name": "preference_jsonl"},
              "train": {"samples": 0}})
