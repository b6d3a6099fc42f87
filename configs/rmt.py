"""Residual Matrix Transformer (``config.model.residual="rmt"``; ``docs/methods/rmt.md``).

Run:
  python -m icml_jax.main --config=configs/rmt.py:small --workdir=runs/rmt_small
  python -m icml_jax.main --config=configs/rmt.py:tiny --workdir=/tmp/rmt --config.train.steps=20
  python -m icml_jax.main --config=configs/rmt.py:small --workdir=runs/rmt_dk8 --config.model.rmt.key_dim=8

Presets compose ``configs/lm.py``'s base config (byte tokens on Shakespeare by default). All use
the reference defaults: ALiBi, RMSNorm over the whole matrix (eps 1e-6), inverse layer scaling,
muP init with a zero unembedding (query slice random, as executed), the ``gelu_tanh`` FFN, z-loss
1e-4, AdamW(0.9, 0.95, 1e-8) with weight decay 1e-4 added after the lr scaling (so the effective
decay is schedule(t)·1e-4·θ, independent of the peak lr, as in the reference), warmup then cosine
to 10%, clipping at 1. The model reuses num_layers (L), num_heads (= num_kv_heads, R), head_dim
(Dv), ffn_dim (N_ff); ``rmt.key_dim`` is Dk; d_model is unused.

  ``tiny``        tests: L=2, R=2, Dv=8, Dk=4, N_ff=32 (seconds).
  ``small``       tiny RMT: L=4, Dv=32, R=4, N_ff=512, Dk=32 (CPU, minutes); lr 1e-2 as
                  the reference (params.yaml), 10% warmup.
  ``repo_134m``   the reference repo's params.yaml model: L=12, Dk=32, Dv=64, R=12, N_ff=3072,
                  GPT-2 vocab size, seq 512, batch 64, lr 1e-2, 5000 steps, 500 warmup (accelerator;
                  needs a GPT-2 SentencePiece/BPE tokenizer and corpus set via config.data.*).
  ``paper_305m``  paper's 305M RMT: L=24, Dk=64, Dv=64, R=16, N_ff=4096 (accelerator).
"""
from icml_jax.config_utils import sibling_config

lm = sibling_config(__file__)  # configs/ is not a package

_RMT = dict(residual="rmt", norm_eps=1e-6, tie_embeddings=False, init_std=0.02,
            mlp=dict(activation="gelu_tanh"))
_TRAIN = dict(z_loss=1e-4, weight_decay=1e-4, b1=0.9, b2=0.95, eps=1e-8, clip_norm=1.0,
              min_lr_ratio=0.1)


def _preset(model, data, train):
    return dict(model={**_RMT, **model}, data=data, train={**_TRAIN, **train})


PRESETS = {
    "tiny": _preset(
        dict(num_layers=2, num_heads=2, num_kv_heads=2, head_dim=8, ffn_dim=32, max_seq_len=128,
             rmt=dict(key_dim=4)),
        dict(seq_len=32),
        dict(steps=20, batch_size=8, lr=1e-2, warmup_steps=2, log_every=5, eval_every=10,
             eval_batches=2, checkpoint_every=10, samples=1, sample_len=16, progress=False,
             async_checkpoint=False)),
    "small": _preset(
        dict(num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32, ffn_dim=512, max_seq_len=512,
             rmt=dict(key_dim=32)),
        dict(seq_len=256),
        dict(steps=400, batch_size=16, lr=1e-2, warmup_steps=40, eval_every=100,
             checkpoint_every=100)),
    "repo_134m": _preset(
        dict(num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64, ffn_dim=3072,
             vocab_size=50304, max_seq_len=512, dtype="bfloat16", rmt=dict(key_dim=32)),
        dict(seq_len=512),
        dict(steps=5000, batch_size=64, lr=1e-2, warmup_steps=500)),
    "paper_305m": _preset(
        dict(num_layers=24, num_heads=16, num_kv_heads=16, head_dim=64, ffn_dim=4096,
             vocab_size=50304, max_seq_len=512, dtype="bfloat16", remat="dots", scan_layers=True,
             rmt=dict(key_dim=64)),
        dict(seq_len=512),
        dict(steps=23000, batch_size=512, lr=1e-2, warmup_steps=1150)),
}


def get_config(preset: str = "small"):
    """Returns the config of a named preset (see PRESETS)."""
    return lm.preset_config(PRESETS, preset, default="small", where="configs/rmt.py")
