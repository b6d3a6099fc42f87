"""Bradley-Terry reward models with batch-wise sum-to-zero regularisation (BSR; docs/methods/bsr.md).

Run (pairs in TRL's JSONL format; init_from: an LM workdir whose decoder becomes the backbone):
  python -m icml_jax.main --config=configs/reward_model.py:default --workdir=runs/rm_bsr \
      --config.data.path=pairs.jsonl --config.data.eval_path=val.jsonl \
      --config.train.init_from=runs/sft
  ... --config.loss.bsr_lambda=0                      # plain BT
The experiment (BT vs BT+BSR on a gold-reward testbed):
  python -m experiments.bsr_robustness --workdir=runs/bsr [--preset=tiny|default]

``config.loss`` (reference defaults: LinkedIn-XFACT/RM-Robustness ``RewardConfig``):
  variant             bt | hinge | normalized | eurus (the reference's baselines)
  margin              BT margin / hinge margin (0)
  center_coef         Eisenstein et al.'s reward centring, coef * (r_w + r_l)^2 (0 = off)
  bsr_lambda          BSR lambda (1e-3, the paper's; 0 = plain BT)
  bsr_scale_by_batch  lambda_eff = lambda * per-device batch (True, the reference)
  bsr_reduce          local: the mean over each data shard's rows (the reference) | global
  bsr_num_shards      0 = the mesh's data * fsdp; n > 0 computes the local means over n row
                      blocks whatever the devices (reproduces an n-device run on one device)
  reward_position     where the score head reads the backbone: last (the last real token, the
                      appended eos; TRL's) | last_response_token (the token before that eos)

Presets: ``tiny`` (tests), ``default`` (the testbed SFT policy's shape: 4 layers, d=128, byte tokens).
"""
import ml_collections

from icml_jax.config_utils import sibling_config

lm = sibling_config(__file__)

LOSS = dict(variant="bt", margin=0.0, center_coef=0.0, bsr_lambda=1e-3, bsr_scale_by_batch=True,
            bsr_reduce="local", bsr_num_shards=0, reward_position="last")

PRESETS = {
    "tiny": dict(
        # configs/lm.py:tiny's model, so that an lm.py:tiny run is the SFT start
        model=dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64,
                   max_seq_len=128),
        data=dict(seq_len=48),
        train=dict(steps=20, batch_size=8, lr=3e-3, warmup_steps=2, log_every=5, eval_every=10,
                   eval_batches=2, checkpoint_every=10, progress=False, async_checkpoint=False),
    ),
    "default": dict(
        # the preference testbed's SFT policy (experiments/preference_testbed.DEFAULT); prompts of
        # <= 63 bytes + 128-byte responses + bos/eos fit in 200 tokens
        model=dict(d_model=128, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32, ffn_dim=384,
                   max_seq_len=256),
        data=dict(seq_len=200),
        train=dict(steps=300, batch_size=16, lr=1e-4, warmup_steps=15, min_lr_ratio=0.0,
                   weight_decay=0.0, log_every=10, eval_every=100, eval_batches=16,
                   checkpoint_every=100, progress=True),
    ),
}


def get_config(preset: str = "default") -> ml_collections.ConfigDict:
    """``configs/lm.py``'s base with task="reward_model", preference data and ``config.loss``."""
    return lm.preset_config(
        PRESETS, preset, default="default", where="configs/reward_model.py", sections={"loss": LOSS},
        base={"task": "reward_model", "data": {"name": "preference_jsonl"},
              "train": {"samples": 0, "clip_norm": 1.0}})
