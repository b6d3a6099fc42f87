"""The presets of experiments/rmt as ConfigDicts, the learning-rate probe behind the default one,
and the plain dict each preset was saved as before (config.json's "exp" section)."""
from experiments.common import preset, record

# The tiny transformer of the experiment, GPT-2-like so that only the residual stream differs
# from the RMT (a ``model`` section of run-config overrides).
TRANSFORMER = dict(d_model=128, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32,
                   ffn_dim=512, mlp=dict(activation="gelu_tanh"), tie_embeddings=False,
                   position="alibi")

# transformer / rmt / train: run-config overrides, nested (model.d_model, train.steps); train is
# shared by every run; lr: peak learning rate per family (each family keeps the rest of its
# config: the RMT its reference optimiser settings and z-loss).
PRESETS = {
    "tiny": preset(
        seeds=(0,), sweep_seeds=(0,), key_dims=(2, 8), main_key_dim=8,
        transformer=dict(model={**TRANSFORMER, "d_model": 32, "num_layers": 1, "num_heads": 2,
                                "num_kv_heads": 2, "head_dim": 16, "ffn_dim": 64,
                                "max_seq_len": 128}),
        rmt=dict(model=dict(num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, ffn_dim=64,
                            max_seq_len=128)),
        lr=dict(transformer=1e-2, rmt=1e-2),
        # seq_len 128 although the models are tiny: the trainer packs the whole validation split
        # into rows before picking eval batches, and that costs per row
        train=dict(data=dict(seq_len=128),
                   train=dict(steps=24, batch_size=4, warmup_steps=3, log_every=4, eval_every=8,
                              eval_batches=2, checkpoint_every=12)),
    ),
    "default": preset(
        seeds=(0, 1), sweep_seeds=(0,), key_dims=(4, 8, 16, 32), main_key_dim=16,
        transformer=dict(model=dict(TRANSFORMER)),
        rmt={},
        # peak lr per family: the best in LR_PROBE (1e-2 is also the RMT reference's lr)
        lr=dict(transformer=3e-3, rmt=1e-2),
        train=dict(data=dict(seq_len=128),
                   train=dict(steps=250, batch_size=8, warmup_steps=25, log_every=10,
                              eval_every=50, eval_batches=12, checkpoint_every=125)),
    ),
}

# The probe that chose the default preset's peak lr per family (measured once, 2026-12-01, not
# rerun by the experiment): 80 steps x 8 rows x 128 tokens, warmup 8, seed 0, dev loss on 4
# validation batches; transformer at the spec shape, RMT at Dk=16, N_ff=512.
LR_PROBE = {"transformer": {3e-3: 2.7571, 1e-2: 3.0314},
            "rmt": {3e-3: 2.8999, 1e-2: 2.7527, 3e-2: 3.1690}}

def as_dict(exp) -> dict:
    """A preset (with the command line's changes) as config.json's "exp" section: the run-config
    sections as flat override keys (``{"model.d_model": 32}``), lists for tuples."""
    return record(exp, flat=("transformer", "rmt", "train"))
