"""The toy superposition study: token features of Markov chains seen at different frequencies.

Data: ``num_chains`` Markov chains over disjoint blocks of ``chain_tokens`` tokens (chain c owns
tokens c·K … c·K + K − 1). Each chain's transition matrix has rows drawn from a Dirichlet with
concentration ``alpha`` (fixed per seed); a sequence picks its chain with the sampling
probabilities, starts at a uniform token of that chain and walks ``seq_len`` − 1 steps. Chain 0
is the swept one: its probability is p, the other chains share 1 − p equally.

Model: our decoder (``icml_jax.models.build_model``) with a ``d_model``-dimensional residual
stream, untied embeddings, trained on next-token prediction with AdamW. Every (frequency, seed)
model is trained at once under ``jax.vmap`` (same step count, its own data and init).

Features: the unembedding's token directions, i.e. the columns of ``lm_head`` scaled by the final
RMSNorm's gain (the vectors the normalised hidden state is dotted with), and, as a second reading,
the embedding rows. Entanglement E_i = max_{j≠i} |cos(v_i, v_j)| over all tokens
(``icml_jax.analysis.entanglement``).
"""
import math

import numpy as np


def model_config(exp):
    """configs/lm.py's base model, sized by the toy preset (d_model = the residual dimension)."""
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/lm.py:tiny", unlocked=True)
    m = cfg.model
    m.update(dict(vocab_size=exp.num_chains * exp.chain_tokens, d_model=exp.d_model, num_layers=exp.num_layers,
                  num_heads=exp.num_heads, num_kv_heads=exp.num_heads, head_dim=exp.head_dim,
                  ffn_dim=exp.ffn_dim, max_seq_len=exp.seq_len, tie_embeddings=False, init_std=exp.init_std))
    return m


def chain_probs(p: float, num_chains: int) -> np.ndarray:
    """Chain 0 at ``p``, the others sharing 1 − p equally."""
    if not 0 < p < 1:
        raise ValueError(f"a swept frequency must be in (0, 1), got {p}")
    return np.array([p] + [(1 - p) / (num_chains - 1)] * (num_chains - 1))


def transition_matrix(seed: int, num_chains: int, chain_tokens: int, alpha: float) -> np.ndarray:
    """The block-diagonal [V, V] next-token matrix of all chains (row = current token)."""
    rng = np.random.default_rng(seed)
    V = num_chains * chain_tokens
    P = np.zeros((V, V))
    for c in range(num_chains):
        s = slice(c * chain_tokens, (c + 1) * chain_tokens)
        P[s, s] = rng.dirichlet(np.full(chain_tokens, alpha), size=chain_tokens)
    return P


def entropy_rate(P: np.ndarray, chain: int, chain_tokens: int, seq_len: int) -> float:
    """The best possible mean next-token loss (nats) on one chain's sequences: the conditional
    entropy of each step, averaged over the seq_len − 1 predicted positions, from the uniform
    start distribution propagated through the chain."""
    s = slice(chain * chain_tokens, (chain + 1) * chain_tokens)
    Q = P[s, s]
    row_h = -np.sum(np.where(Q > 0, Q * np.log(np.where(Q > 0, Q, 1)), 0), axis=1)
    dist = np.full(chain_tokens, 1.0 / chain_tokens)
    total = 0.0
    for _ in range(seq_len - 1):
        total += dist @ row_h
        dist = dist @ Q
    return float(total / (seq_len - 1))


def sample_batch(key, log_P, log_probs, batch: int, seq_len: int, chain_tokens: int):
    """[batch, seq_len] int32 sequences, and their chains [batch] (jax; inside jit/vmap)."""
    import jax
    import jax.numpy as jnp
    log_P, log_probs = jnp.asarray(log_P), jnp.asarray(log_probs)
    k_chain, k_start, k_walk = jax.random.split(key, 3)
    chains = jax.random.categorical(k_chain, log_probs, shape=(batch,))
    x0 = chains * chain_tokens + jax.random.randint(k_start, (batch,), 0, chain_tokens)

    def step(x, k):
        nxt = jax.random.categorical(k, log_P[x])
        return nxt, nxt
    _, rest = jax.lax.scan(step, x0, jax.random.split(k_walk, seq_len - 1))
    return jnp.concatenate([x0[:, None], rest.T], axis=1).astype(jnp.int32), chains


def features(params, which: str = "unembedding") -> np.ndarray:
    """Token feature vectors [V, D]: the unembedding directions (lm_head columns times the final
    norm's gain) or the embedding rows."""
    io = params["io"]
    if which == "embedding":
        return np.asarray(io["embedding"])
    return np.asarray(io["lm_head"]).T * np.asarray(io["final_norm"]["scale"])[None, :]


def train_all(exp, freqs, seeds):
    """Trains one model per (frequency, seed) under one vmap. Returns a list of dicts
    (freq, seed, params, held-out loss per chain, optimal loss per chain)."""
    import jax
    import jax.numpy as jnp
    import optax

    from icml_jax.losses.logps import token_logprobs
    from icml_jax.models import build_model
    m = model_config(exp)
    model = build_model(m)
    K, C, T, B = exp.chain_tokens, exp.num_chains, exp.seq_len, exp.batch_size
    runs = [(p, s) for p in freqs for s in seeds]
    log_P = np.stack([np.log(np.maximum(transition_matrix(s, C, K, exp.alpha), 1e-30)) for _, s in runs])
    log_probs = np.stack([np.log(chain_probs(p, C)) for p, _ in runs])
    # the same seed gives the same chains and init at every frequency: only the frequency differs
    init_keys = jnp.stack([jax.random.PRNGKey(s) for _, s in runs])
    data_keys = jnp.stack([jax.random.fold_in(jax.random.PRNGKey(s), 1) for _, s in runs])

    def unbox(tree):
        import flax.linen as nn
        return nn.meta.unbox(tree)

    def init(k):
        return unbox(model.init(k, jnp.zeros((1, T - 1), jnp.int32))["params"])

    sched = optax.warmup_cosine_decay_schedule(0.0, exp.lr, exp.warmup_steps, exp.steps, exp.lr * 0.1)
    opt = optax.adamw(sched, b1=0.9, b2=0.99, weight_decay=exp.weight_decay)

    def loss_fn(params, toks):
        logits = model.apply({"params": params}, toks[:, :-1])
        return -token_logprobs(logits, toks[:, 1:]).mean(axis=1)  # per sequence [B]

    def train_one(k_init, k_data, lp, lc):
        params = init(k_init)
        state = opt.init(params)

        def step(carry, k):
            params, state = carry
            toks, _ = sample_batch(k, lp, lc, B, T, K)
            loss, g = jax.value_and_grad(lambda q: loss_fn(q, toks).mean())(params)
            upd, state = opt.update(g, state, params)
            return (optax.apply_updates(params, upd), state), loss
        (params, _), losses = jax.lax.scan(step, (params, state), jax.random.split(k_data, exp.steps))
        # held-out: fresh sequences, an equal number per chain (uniform chain choice)
        toks, chains = sample_batch(jax.random.fold_in(k_data, 7), lp, jnp.zeros(C), exp.eval_batch, T, K)
        per_seq = loss_fn(params, toks)
        onehot = jax.nn.one_hot(chains, C)
        per_chain = (onehot * per_seq[:, None]).sum(0) / jnp.maximum(onehot.sum(0), 1)
        return params, per_chain, losses[-max(1, exp.steps // 20):].mean()

    params, per_chain, train_loss = jax.jit(jax.vmap(train_one))(init_keys, data_keys, jnp.asarray(log_P),
                                                                 jnp.asarray(log_probs))
    params = jax.tree.map(np.asarray, params)
    per_chain, train_loss = np.asarray(per_chain), np.asarray(train_loss)
    out = []
    for i, (p, s) in enumerate(runs):
        P = transition_matrix(s, C, K, exp.alpha)
        out.append(dict(freq=p, seed=s, params=jax.tree.map(lambda x: x[i], params),
                        loss=per_chain[i].tolist(), train_loss=float(train_loss[i]),
                        optimal=[entropy_rate(P, c, K, T) for c in range(C)]))
    return out


def measure(exp, run) -> dict:
    """One run's row: entanglement of each chain's tokens (unembedding and embedding), losses."""
    from icml_jax.analysis.entanglement import entanglement
    K, C = exp.chain_tokens, exp.num_chains
    row = dict(freq=run["freq"], seed=run["seed"], train_loss=run["train_loss"])
    for which, tag in (("unembedding", "E"), ("embedding", "E_emb")):
        e = entanglement(features(run["params"], which))
        for c in range(C):
            row[f"{tag}_chain{c}"] = float(e[c * K:(c + 1) * K].mean())
        row[f"{tag}_others"] = float(e[K:].mean())
        row[f"{tag}_max"] = float(e.max())
        row[f"{tag}_gap"] = row[f"{tag}_chain0"] - row[f"{tag}_others"]  # within one model
    for c in range(C):
        row[f"loss_chain{c}"] = run["loss"][c]
        row[f"optimal_chain{c}"] = run["optimal"][c]
    row["loss"] = float(np.mean(run["loss"]))
    row["optimal"] = float(np.mean(run["optimal"]))
    row["uniform"] = math.log(K)
    return row


def fields(exp):
    C = exp.num_chains
    f = ["freq", "seed"]
    for tag in ("E", "E_emb"):
        f += [f"{tag}_chain{c}" for c in range(C)] + [f"{tag}_others", f"{tag}_max", f"{tag}_gap"]
    f += [f"loss_chain{c}" for c in range(C)] + [f"optimal_chain{c}" for c in range(C)]
    return f + ["loss", "optimal", "uniform", "train_loss"]
