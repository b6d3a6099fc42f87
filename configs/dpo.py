"""DPO (sigmoid / robust / hinge / IPO) and TGDPO (docs/methods/tgdpo.md) from an SFT policy.

Run (pairs in TRL's JSONL format; init_from: the SFT workdir, also the frozen reference):
  python -m icml_jax.main --config=configs/dpo.py:default --workdir=runs/dpo \
      --config.data.path=pairs.jsonl --config.train.init_from=runs/sft
TGDPO, guided by the DPO policy above (same SFT start, same data):
  python -m icml_jax.main --config=configs/dpo.py:default --workdir=runs/tgdpo \
      --config.data.path=pairs.jsonl --config.train.init_from=runs/sft \
      --config.loss.type=tgdpo --config.loss.guidance=runs/dpo
The experiment: python -m experiments.tgdpo_vs_dpo --workdir=runs/tgdpo_vs_dpo [--preset=tiny|default]

``config.loss`` (TRL's DPOConfig names where they exist; TGDPO's from its LLaMA-Factory fork):
  type             sigmoid (DPO) | robust | hinge | ipo | tgdpo
  beta             0.1 (pref_beta)
  label_smoothing  0 (cDPO / robust)
  reference_free   False
  ipo_average      True: IPO on per-token mean log-probs (TRL)
  tgdpo_alpha      0.5 (the reference default; 0 = DPO)
  tgdpo_weight_clip ()  unclipped (the reference) | (lo, hi) clips the guidance factor
  sft_weight       0 (pref_ftx: + weight * mean chosen-token NLL)
  reference        "" = config.train.init_from (the SFT policy)
  guidance         TGDPO's pi_r: a DPO workdir of this config

Presets: ``tiny`` (tests), ``default`` (the testbed SFT policy's shape: 4 layers, d=128, byte tokens).
"""
import ml_collections

from icml_jax.config_utils import sibling_config

lm = sibling_config(__file__)

LOSS = dict(type="sigmoid", beta=0.1, label_smoothing=0.0, reference_free=False, ipo_average=True,
            tgdpo_alpha=0.5, tgdpo_weight_clip=(), sft_weight=0.0, reference="", guidance="")

PRESETS = {
    "tiny": dict(
        # configs/lm.py:tiny's model, so that an lm.py:tiny run is the SFT start
        model=dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64,
                   max_seq_len=128),
        data=dict(seq_len=48),
        train=dict(steps=20, batch_size=8, lr=1e-3, warmup_steps=2, log_every=5, eval_every=10,
                   eval_batches=2, checkpoint_every=10, progress=False, async_checkpoint=False),
    ),
    "default": dict(
        # the preference testbed's SFT policy (experiments/preference_testbed.DEFAULT); prompts of
        # <= 63 bytes + 128-byte responses + bos/eos fit in 200 tokens
        model=dict(d_model=128, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32, ffn_dim=384,
                   max_seq_len=256),
        data=dict(seq_len=200),
        train=dict(steps=200, batch_size=16, lr=5e-5, warmup_steps=20, min_lr_ratio=0.0,
                   weight_decay=0.0, log_every=10, eval_every=100, eval_batches=8,
                   checkpoint_every=100, progress=True),
    ),
}


def get_config(preset: str = "default") -> ml_collections.ConfigDict:
    """``configs/lm.py``'s base with task="preference", preference data and ``config.loss``."""
    return lm.preset_config(
        PRESETS, preset, default="default", where="configs/dpo.py", sections={"loss": LOSS},
        base={"task": "preference", "data": {"name": "preference_jsonl"},
              "train": {"samples": 0}})
