"""Supervised fine-tuning on prompt-completion pairs, optionally with EVIC sample selection
(docs/methods/evic.md).

Run (TRL's prompt-completion JSONL; init_from: a pretrained decoder of the same model):
  python -m icml_jax.main --config=configs/sft.py:default --workdir=runs/sft \
      --config.data.path=train.jsonl --config.train.init_from=runs/pretrain
EVIC (re-select the pool's samples with positive total influence every 200 steps):
  ... --config.evic.enabled=True --config.evic.every=200
The experiment: python -m experiments.evic --workdir=runs/evic [--preset=tiny|default]

``config.evic`` (spec names in brackets):
  enabled        False
  every          200     steps between refreshes [evic_recompute_every]
  start          -1      step of the first refresh (steps before it train on every sample);
                         -1 = ``every``: a warm-up interval first (the spec's warm-up; a refresh
                         at step 0 would score with zero Adam moments, where Gamma is sign(g))
  precond        adam    Gamma = the optimizer's Adam step | sgd (identity: Int symmetric)
  proj           countsketch | rademacher (dense +-1/sqrt(k)) | none (exact) [evic_proj_dim]
  proj_dim       4096    k, the sketch's size
  chunk          16      examples per vmapped gradient (memory ~ 2 * chunk * params floats)
  select         positive (I_j > 0) | top (the top_fraction largest I_j) [evic_select]
  top_fraction   0.5
  seed           0       the sketch's random matrix
  save_matrix_max 2048   Int among the pool's first rows, up to this many, goes to
                         WORKDIR/evic/round_*.npz (I_j always covers the whole pool)
  noise_check    False   also that block's Int under a second sketch (the sketch's own noise)
"""
import ml_collections

from icml_jax.config_utils import sibling_config

lm = sibling_config(__file__)

EVIC = dict(enabled=False, every=200, start=-1, precond="adam", proj="countsketch", proj_dim=4096,
            chunk=16, select="positive", top_fraction=0.5, seed=0, save_matrix_max=2048,
            noise_check=False)

PRESETS = {
    "tiny": dict(
        model=dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64,
                   max_seq_len=128),
        data=dict(seq_len=32),
        train=dict(steps=12, batch_size=8, lr=1e-3, warmup_steps=2, log_every=4, eval_every=6,
                   eval_batches=2, checkpoint_every=6, progress=False, async_checkpoint=False),
    ),
    "default": dict(
        model=dict(d_model=128, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32, ffn_dim=384,
                   max_seq_len=256),
        data=dict(seq_len=128),
        train=dict(steps=1000, batch_size=32, lr=3e-4, warmup_steps=50, log_every=20,
                   eval_every=200, eval_batches=8, checkpoint_every=200, progress=True),
    ),
}


def get_config(preset: str = "default") -> ml_collections.ConfigDict:
    """``configs/lm.py``'s base with task="sft", prompt-completion JSONL data and ``config.evic``."""
    return lm.preset_config(
        PRESETS, preset, default="default", where="configs/sft.py", sections={"evic": EVIC},
        base={"task": "sft", "data": {"name": "preference_jsonl"}, "train": {"samples": 0}})
