"""A step-labelled process reward model (task ``step_prm``, TRL's ``PRMTrainer`` recipe).

  python -m icml_jax.main --config=configs/step_prm.py:default --workdir=runs/step_prm \\
      --config.data.path=steps.jsonl [--config.data.eval_path=val.jsonl] \\
      [--config.train.init_from=runs/sft]

Data: TRL's stepwise-supervision JSONL, ``{"prompt", "completions": [steps], "labels": [bools]}``.
``config.steps``: ``max_steps`` (labelled steps kept per example; later ones are dropped),
``separator`` (appended to every step; the label sits on its last token, TRL's default "\\n").

Presets: ``tiny`` (tests), ``default`` (the implicit-PRM testbed's shape: 4 layers, d=128).
"""
import ml_collections

from icml_jax.config_utils import sibling_config

lm = sibling_config(__file__)

STEPS = dict(max_steps=8, separator="\n")

PRESETS = {
    "tiny": dict(
        model=dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64,
                   max_seq_len=128),
        data=dict(seq_len=64),
        steps=dict(max_steps=4),
        train=dict(steps=30, batch_size=8, lr=3e-3, warmup_steps=2, log_every=10, eval_every=30,
                   eval_batches=2, checkpoint_every=30, progress=False, async_checkpoint=False),
    ),
    # the implicit PRM's default shape and schedule, so that the two PRMs compare like for like
    "default": sibling_config(__file__, "implicit_prm.py").PRESETS["default"],
}


def get_config(preset: str = "default") -> ml_collections.ConfigDict:
    """``configs/lm.py``'s base with task="step_prm", stepwise data and ``config.steps``."""
    return lm.preset_config(
        PRESETS, preset, default="default", where="configs/step_prm.py", sections={"steps": STEPS},
        base={"task": "step_prm", "data": {"name": "preference_jsonl"}, "train": {"samples": 0}})
