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


def _run_train(steps, batch_size, lr, warmup_steps, log_every, **more):
    """A run's ``train`` overrides, evaluated and saved once, at its end."""
    return dict(steps=steps, batch_size=batch_size, lr=lr, warmup_steps=warmup_steps,
                log_every=log_every, eval_every=steps, checkpoint_every=steps,
                async_checkpoint=False, **more)


def _additive(*, corpus_docs, batch_size, prompts, sft_model, sft_train, train, **arms):
    """A preset on the token-additive gold world (icml_jax/data/additive_gold.py, built by
    experiments/additive_testbed.py): gold(y) = sum_t w[y_t] is known per token. "world" replaces
    "testbed"; the guidance pi_r is a DPO policy (beta = `beta`) trained on pairs of the
    `guidance_train` prompts, disjoint from the policies' `tgdpo_train` prompts; arms: alpha in
    `alphas` (0 = DPO) x beta in `betas`, and DPO at every step count of `dpo_steps` (the KL
    sweep). The two presets share the world and differ in size only."""
    world = dict(world_seed=0, num_letters=8, prompt_len=6, response_len=10,
                 corpus_docs=corpus_docs, corpus_seed=1, prompt_seed=2, temperature=1.0,
                 max_new_tokens=10, batch_size=batch_size,
                 prompts=dict(zip(("tgdpo_train", "guidance_train", "tgdpo_eval"), prompts)),
                 responses=dict(tgdpo_train=4, guidance_train=4, tgdpo_eval=4),
                 sft=dict(model=dict(sft_model, max_seq_len=64), data=dict(seq_len=64),
                          train=sft_train))
    return preset(world=world, guidance_seed=1000, beta=0.1, eval_samples=4, eval_temperature=1.0,
                  eval_seed=4242, eval_batch_size=batch_size, train=dict(train=train), **arms)


PRESETS.update({
    "additive_tiny": _additive(
        corpus_docs=400, batch_size=64, prompts=(16, 16, 8),
        sft_model=dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
                       ffn_dim=64),
        sft_train=_run_train(30, 8, 1e-2, 3, 10, eval_batches=1),
        train=_run_train(8, 4, 1e-3, 1, 2),
        seeds=(0,), alphas=(0.0, 1.0), betas=(0.1,), dpo_steps=(16,)),
    "additive": _additive(
        corpus_docs=4000, batch_size=256, prompts=(300, 300, 100),
        sft_model=dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
                       ffn_dim=192),
        sft_train=_run_train(400, 16, 3e-3, 20, 50, eval_batches=4),
        train=_run_train(60, 16, 1e-3, 6, 10),
        # dpo_steps: DPO again at 2x and 4x the steps (60-step DPO stays at KL 7-9 nats for every
        # beta while TGDPO reaches 10-20: matched-KL comparisons need DPO points up there)
        seeds=(0, 1, 2), alphas=(0.0, 0.5, 1.0), betas=(0.05, 0.1, 0.3), dpo_steps=(120, 240)),
})


def is_additive(exp) -> bool:
    """Whether ``exp`` runs on the token-additive gold world (a ``world`` section)."""
    return "world" in exp


def saved_experiment(exp) -> dict:
    """``exp`` (after the command-line overrides) as config.json's "experiment" section: the
    testbed preset in full and the run-config overrides as flat ``train.*`` keys."""
    if is_additive(exp):
        return record(exp, flat=("train",))
    return {**record(exp, flat=("train",)), "testbed": preference_testbed.preset_dict(exp.testbed)}
