"""The presets of experiments/tgdpo_vs_dpo as ConfigDicts, and a preset as config.json records it."""
from experiments import preference_testbed
from experiments.common import preset, record

# testbed: a preset name of experiments.preference_testbed.PRESETS (its "sft" section has dotted
# keys, which a ConfigDict cannot hold); train: the run-config overrides, nested (train.steps)
PRESETS = {
    "tiny": preset(
        testbed="tiny", seeds=(0,), alphas=(0.5,), guidance_seed=1000,
        beta=0.1, eval_samples=2, eval_temperature=0.8, eval_seed=4242, eval_batch_size=32,
        train=dict(train=dict(steps=10, batch_size=4, lr=1e-3, warmup_steps=1, log_every=2,
                              eval_every=10, checkpoint_every=10, async_checkpoint=False)),
    ),
    "default": preset(
        testbed="default", seeds=(0, 1), alphas=(0.5,), guidance_seed=1000,
        beta=0.1, eval_samples=4, eval_temperature=0.8, eval_seed=4242, eval_batch_size=64,
        # lr / steps from a probe (DPO, seed 0, not rerun by the experiment): at 3e-4 x 120 steps
        # the policy won 0.73 against SFT at a KL of 33 nats (train acc 1.0, val pair acc 0.60),
        # already overfit; 60 steps (2.6 epochs of the pairs) halves the cost
        train=dict(train=dict(steps=60, batch_size=16, lr=3e-4, warmup_steps=6, log_every=5,
                              eval_every=30, checkpoint_every=30)),
    ),
}

def saved_experiment(exp) -> dict:
    """``exp`` (after the command-line overrides) as config.json's "experiment" section: the
    testbed preset in full and the run-config overrides as flat ``train.*`` keys."""
    return {**record(exp, flat=("train",)), "testbed": preference_testbed.preset_dict(exp.testbed)}
