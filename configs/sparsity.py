"""Sparsing Law (Luo et al., ICML 2025): ReLU-GLU vs SiLU-GLU decoders for activation-sparsity trends.

Run one model (ReLU-GLU; ``--config.model.mlp.activation=swiglu`` for the SiLU twin):
  python -m icml_jax.main --config=configs/sparsity.py:default --workdir=runs/sparsity_relu
The experiment (both activations, checkpoints along training, CETT-PPL-1% at each, fitted laws):
  python -m experiments.sparsity_law --workdir=runs/sparsity_law [--preset=tiny|default]

``configs/lm.py``'s base config with the gated ReLU FFN (``relu_glu``) and a constant learning rate
after warmup (``min_lr_ratio=1``): the paper's checkpoints come from the stable phase of training,
and a decaying schedule would mix the learning-rate decay into the activation-ratio-vs-tokens
trend. The two models of the experiment differ only in ``config.model.mlp.activation``.

Presets:
  ``tiny``     seconds; tests.
  ``default``  the method page's experiment model: 2 layers, d_model 64, d_ff 256, 2 heads of 32, byte tokens,
               batch 16 x 128, 2000 steps (4.1M tokens, about one pass over the train split), constant lr
               3e-3 after 25 warmup steps. A checkpoint every 500 steps (~2 MB each); the experiment adds
               its log-spaced evaluation steps through ``train.checkpoint_steps``.
"""
import ml_collections

from icml_jax.config_utils import sibling_config

# configs/ is not a package: run configs/lm.py by path for its base_config and _flatten
lm = sibling_config(__file__)

PRESETS = {
    "tiny": dict(
        model=dict(d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, ffn_dim=64,
                   max_seq_len=64),
        data=dict(seq_len=32),
        train=dict(steps=40, batch_size=8, lr=1e-2, warmup_steps=4, min_lr_ratio=1.0, log_every=10,
                   eval_every=40, eval_batches=2, checkpoint_every=20, keep_checkpoints=1000,
                   samples=0, progress=False, async_checkpoint=False),
    ),
    "default": dict(
        model=dict(d_model=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32, ffn_dim=256,
                   max_seq_len=128),
        data=dict(seq_len=128),
        train=dict(steps=2000, batch_size=16, lr=3e-3, warmup_steps=25, min_lr_ratio=1.0,
                   log_every=50, eval_every=2000, eval_batches=4, checkpoint_every=500,
                   keep_checkpoints=1000, samples=0, progress=False, async_checkpoint=False),
    ),
}


def get_config(preset: str = "default") -> ml_collections.ConfigDict:
    """``configs/lm.py``'s base config with activation="relu_glu" and a preset of PRESETS."""
    return lm.preset_config(PRESETS, preset, default="default", where="configs/sparsity.py",
                               base={"model": {"mlp": {"activation": "relu_glu"}}})
