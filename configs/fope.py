"""FoPE (Fourier Position Embedding) language models and the length-generalisation experiment.

Run one model:
  python -m icml_jax.main --config=configs/fope.py:default --workdir=runs/fope
  python -m icml_jax.main --config=configs/fope.py:default --workdir=runs/rope --config.model.position=rope
The experiment (RoPE / FoPE / ALiBi / NoPE, 2 seeds, eval to 8x the training length):
  python -m experiments.fope_length --workdir=runs/fope_length [--preset=tiny|default]

Presets (all: position="fope" with the reference defaults of docs/methods/fope.md, multi-head attention
so that FoPE's per-head coefficients are exactly the reference's; ``train_seq_len`` = data.seq_len
and ``max_seq_len`` = 8x it so the same model evaluates up to 8x the training length):
  ``tiny``     seconds; tests and the notebook.
  ``default``  the experiment's CPU model: L = 64, d_model 128, 2 layers, 4 heads of 32.
  ``spec``     the method page's reproduction model: L = 128, d_model 256, 4 layers, 4 heads of 64
               (D_in = D_out = 11); max_seq_len 2048 (16x). Tens of minutes per 1k steps on a CPU.
"""
import ml_collections

from icml_jax.config_utils import sibling_config


lm = sibling_config(__file__)  # configs/ is not a package

PRESETS = {
    "tiny": dict(
        model=dict(d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, ffn_dim=64,
                   max_seq_len=256, train_seq_len=32),
        data=dict(seq_len=32),
        train=dict(steps=30, batch_size=8, lr=1e-2, warmup_steps=3, log_every=10, eval_every=30,
                   eval_batches=2, checkpoint_every=30, samples=0, progress=False,
                   async_checkpoint=False),
    ),
    "default": dict(
        model=dict(d_model=128, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=32, ffn_dim=352,
                   max_seq_len=512, train_seq_len=64),
        data=dict(seq_len=64),
        train=dict(steps=600, batch_size=16, lr=3e-3, warmup_steps=50, log_every=50, eval_every=300,
                   eval_batches=4, checkpoint_every=300, samples=0, progress=False),
    ),
    "spec": dict(
        model=dict(d_model=256, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=64, ffn_dim=704,
                   max_seq_len=2048, train_seq_len=128),
        data=dict(seq_len=128),
        train=dict(steps=3000, batch_size=16, lr=3e-3, warmup_steps=200, eval_every=500,
                   checkpoint_every=500, samples=0),
    ),
}


def get_config(preset: str = "default") -> ml_collections.ConfigDict:
    """``configs/lm.py``'s base config with position="fope" and a preset of PRESETS."""
    return lm.preset_config(PRESETS, preset, default="default", where="configs/fope.py",
                            base={"model": {"position": "fope"}})
