"""Fed-ICL's ICL model: an ``ICLRegressor`` (our decoder blocks, real-valued read-in / read-out)
trained on ``data.icl_regression`` prompts (``federated_training_batch`` by default, as the
protocol builds them; ``training_batch``: random regions of x-space), each with random
demonstration counts and, in the query slot, a previous answer (absent or noisy) to refine."""
import numpy as np


def model_config(exp):
    """config.model of configs/lm.py with the preset's sizes, NoPE and a prompt of K·m + 1 slots."""
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/lm.py:tiny").model
    cfg.update(dict(d_model=exp.d_model, num_layers=exp.num_layers, num_heads=exp.num_heads,
                    num_kv_heads=exp.num_heads, head_dim=exp.d_model // exp.num_heads, ffn_dim=exp.ffn_dim,
                    position="nope", max_seq_len=exp.K * exp.m + 1))
    return cfg


def train(exp, seed: int):
    """(model, params, train losses [steps]) for one seed: AdamW, cosine decay, MSE on the clean
    query label, fresh prompts every step."""
    import jax
    import jax.numpy as jnp
    import optax

    from icml_jax.data.icl_regression import federated_training_batch, training_batch
    from icml_jax.models.icl_regressor import build_icl_regressor
    model = build_icl_regressor(model_config(exp), exp.products)
    S, d = exp.K * exp.m, exp.d
    params = jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros((1, S, d)), jnp.zeros((1, S)),
                                 jnp.ones((1, S), bool), jnp.zeros((1, d)), jnp.zeros(1), jnp.zeros(1, bool))["params"]
    sched = optax.warmup_cosine_decay_schedule(0.0, exp.lr, exp.warmup_steps, exp.steps, exp.lr * 0.05)
    opt = optax.adamw(sched, weight_decay=exp.weight_decay)
    state = opt.init(params)

    @jax.jit
    def step(params, state, b):
        def loss_fn(p):
            pred = model.apply({"params": p}, b["X"], b["Y"], b["mask"], b["xq"], b["hint"], b["has_hint"])
            return jnp.mean((pred - b["yq"]) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss

    rng = np.random.default_rng(1000 + seed)
    losses = []
    for _ in range(exp.steps):
        if exp.train_prompts == "federated":  # prompts shaped like the clients' and the centralised one
            b = federated_training_batch(rng, exp.batch_size, exp.K, exp.n, exp.m, exp.d, offset=exp.offset,
                                         spread=exp.spread, noise=exp.noise, p_no_hint=exp.p_no_hint)
        else:
            b = training_batch(rng, exp.batch_size, S, exp.d, noise=exp.noise, offset_max=exp.train_offset_max,
                               p_no_hint=exp.p_no_hint)
        b = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in b.items()}
        params, state, loss = step(params, state, b)
        losses.append(loss)
    return model, params, np.asarray(jax.device_get(losses), np.float64)
