"""The presets of experiments/rmt as ConfigDicts (with the learning-rate grid per tuned shape)
and the plain dict each preset was saved as (config.json's "exp" section)."""
from experiments.common import preset, record

# The tiny transformer of the experiment, GPT-2-like so that only the residual stream differs
# from the RMT (a ``model`` section of run-config overrides).
TRANSFORMER = dict(d_model=128, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32,
                   ffn_dim=512, mlp=dict(activation="gelu_tanh"), tie_embeddings=False,
                   position="alibi")

# transformer / rmt / train: run-config overrides, nested (model.d_model, train.steps); train is
# shared by every run. Each family keeps the rest of its config (the RMT its reference optimiser
# settings and z-loss). Peak learning rate, per tuned shape (``transformer``; ``rmt_matched``;
# ``rmt_spec``, the spec-shaped RMT of the Dk sweep): ``lr_grid`` lists the values the lr stage tries
# for a shape (``grid_steps`` steps, seed ``grid_seed``, the same warmup fraction); the value with
# the lowest final dev loss is used by that shape's runs. ``lr`` is the value of a shape without a
# grid, or given on the command line (``--lr``: fixed, its grid is skipped).
PRESETS = {
    "tiny": preset(
        seeds=(0,), sweep_seeds=(0,), key_dims=(2, 8), main_key_dim=8,
        transformer=dict(model={**TRANSFORMER, "d_model": 32, "num_layers": 1, "num_heads": 2,
                                "num_kv_heads": 2, "head_dim": 16, "ffn_dim": 64,
                                "max_seq_len": 128}),
        rmt=dict(model=dict(num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, ffn_dim=64,
                            max_seq_len=128)),
        lr=dict(transformer=1e-2, rmt_matched=1e-2, rmt_spec=1e-2),
        lr_grid=dict(transformer=(3e-3, 1e-2)), grid_steps=8, grid_seed=0,
        # seq_len 128 although the models are tiny: the trainer packs the whole validation split
        # into rows before picking eval batches, and that costs per row
        train=dict(data=dict(seq_len=128),
                   train=dict(steps=24, batch_size=4, warmup_steps=3, log_every=4, eval_every=8,
                              eval_batches=2, checkpoint_every=12)),
    ),
    "default": preset(
        seeds=(0, 1, 2), sweep_seeds=(0, 1, 2), key_dims=(4, 8, 16, 32), main_key_dim=16,
        transformer=dict(model=dict(TRANSFORMER)),
        rmt={},
        # used only where a shape is not tuned (benchmarks/rmt_cost.py times steps with them):
        # the former one-off probe's picks (1e-2 is also the RMT reference's lr)
        lr=dict(transformer=3e-3, rmt_matched=1e-2, rmt_spec=1e-2),
        lr_grid=dict(transformer=(1e-3, 3e-3, 1e-2), rmt_matched=(3e-3, 1e-2, 3e-2),
                     rmt_spec=(3e-3, 1e-2, 3e-2)),
        grid_steps=100, grid_seed=0,
        train=dict(data=dict(seq_len=128),
                   train=dict(steps=200, batch_size=8, warmup_steps=20, log_every=10,
                              eval_every=25, eval_batches=8, checkpoint_every=100)),
    ),
}


def as_dict(exp) -> dict:
    """A preset (with the command line's changes) as config.json's "exp" section: the run-config
    sections as flat override keys (``{"model.d_model": 32}``), lists for tuples."""
    return record(exp, flat=("transformer", "rmt", "train"))
