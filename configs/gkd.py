"""Puzzle's global knowledge distillation (GKD; docs/methods/puzzle.md): a child decoder
(``config.model.blocks``) trained against its frozen parent (task ``gkd``).

Run (the parent: a configs/lm.py run; the child: a workdir whose newest checkpoint holds the
assembled child's params, with the same model settings and blocks as here):
  python -m icml_jax.main --config=configs/gkd.py:tiny --workdir=runs/gkd \\
      --config.gkd.teacher=runs/parent --config.train.init_from=runs/child \\
      --config.model.blocks.attention=1,linear --config.model.blocks.ffn=noop,32

``config.gkd``:
  teacher        the parent's training workdir (required): model config from its config.json,
                 params from its newest checkpoint; same tokenizer, vocab_size, num_layers and
                 d_model as config.model
  cosine_weight  1.0: sum over layers of 1 - cos(h_l^parent, h_l^child) per token
  kl_weight      1.0: KL(p_parent || p_child) per token
  lm_weight      0.0: the child's LM cross-entropy (the paper found that adding it hurt)

Presets: ``tiny`` (tests; configs/lm.py:tiny's model), ``small`` (configs/lm.py:small's model).
"""
import ml_collections

from icml_jax.config_utils import sibling_config

lm = sibling_config(__file__)

GKD = dict(teacher="", cosine_weight=1.0, kl_weight=1.0, lm_weight=0.0)

# the parent's model and rows (configs/lm.py's preset of the same name); a child changes only
# config.model.blocks
PRESETS = {
    "tiny": dict(
        model=lm.PRESETS["tiny"]["model"], data=lm.PRESETS["tiny"]["data"],
        train=dict(steps=8, batch_size=8, lr=3e-3, warmup_steps=1, log_every=4, eval_every=8,
                   eval_batches=2, checkpoint_every=8, progress=False, async_checkpoint=False),
    ),
    "small": dict(
        model=lm.PRESETS["small"]["model"], data=lm.PRESETS["small"]["data"],
        train=dict(steps=400, batch_size=16, lr=1e-3, warmup_steps=40, eval_every=100,
                   checkpoint_every=100),
    ),
}


def get_config(preset: str = "small") -> ml_collections.ConfigDict:
    """``configs/lm.py``'s base with task="gkd" and ``config.gkd``."""
    return lm.preset_config(PRESETS, preset, default="small", where="configs/gkd.py",
                            sections={"gkd": GKD}, base={"task": "gkd", "train": {"samples": 0}})
