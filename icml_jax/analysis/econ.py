"""ECON's orchestration with tiny LMs (docs/methods/econ.md): belief networks choose each
executor's sampling parameters, frozen executor LMs answer independently, a frozen coordinator
LM commits to one answer, and the belief networks, belief encoder and mixer learn from the
team reward with the reference's three optimizers.

One round on B questions (``Harness.round``):

1. observation tokens [B, N, L] (the question, for every agent) -> ``BeliefNetworks`` -> beliefs,
   local Q_i, actions (T_i, p_i); the belief encoder gives the group representation E;
2. executor i samples one answer at its own (T_i, p_i) (``sample_answers``: the codebase's
   KV-cache decoding with temperature and top-p per call);
3. the coordinator commits to the candidate it finds most likely (``commit``: the log-prob of
   each distinct parsed answer given the question under the coordinator LM; our stand-in for a
   50-token commitment written by an API model);
4. rewards (``toy_rewards``): TS = commitment correct, AL = share of executors whose answer equals
   the commitment, CC = 0.3·TS + 0.3·(distinct answers / N) + 0.2·AL; R = 0.3 AL + 0.5 TS + 0.2 CC
   (the environment's weights);
5. ``train_step``: stage 1 (belief networks, encoder), stage 2 (``bne_refine``), the mixer on the
   stage-2 group, and one optimizer step per parameter group, each on its own loss: belief
   networks on ``belief_loss``, encoder on ``encoder_loss``, mixer on ``mix_loss`` (as the
   reference, whose later backward passes only add gradients the next zero_grad discards).

The commitment embedding E(·) is the mean-pooled last-layer residual stream of a frozen LM on
question + commitment. Every LM stays frozen: only the harness parameters receive gradients.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from icml_jax.inference import decode
from icml_jax.losses import econ as L
from icml_jax.models import econ as M
from icml_jax.models import hooks
from icml_jax.models.decoder import build_model


@dataclasses.dataclass(frozen=True)
class EconConfig:
    """Harness sizes and the reference's training settings (defaults: the authors' config,
    except the widths, which the tiny study shrinks)."""
    n_agents: int = 3
    obs_len: int = 32
    hidden_dim: int = 256
    belief_dim: int = 128
    heads: int = 4
    layers: int = 2
    mixing_dim: int = 32
    feature_dim: int = 64
    hyper_hidden: int = 128
    shared: bool = False          # True: the reference's single belief network for all agents
    lr: float = 1e-3              # belief_net_lr = encoder_lr = mixer_lr
    clip: float = 10.0
    gamma: float = 0.99
    lambda_sd: float = 0.1
    lambda_m: float = 0.1
    stage2_weight: float = 0.3
    bne_max_iters: int = 5
    bne_tol: float = 0.01
    bne_rate: float = 0.1
    target_every: int = 200       # target networks copied every this many train steps
    reference_broadcast: bool = False

    def __post_init__(self):
        for f in ("n_agents", "obs_len", "hidden_dim", "belief_dim", "heads", "layers"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"EconConfig.{f}={getattr(self, f)} must be >= 1")
        if self.hidden_dim % (2 * self.heads) or self.belief_dim % self.heads:
            raise ValueError(f"EconConfig: hidden_dim ({self.hidden_dim}) must divide into 2 x heads "
                             f"({self.heads}) and belief_dim ({self.belief_dim}) into heads")


class Harness:
    """The trainable part: belief networks, belief encoder, mixer, their optimizers and target
    copies. ``vocab_size`` / ``pad_id``: the observation tokenizer's; ``commit_dim``: the
    commitment embedding width."""

    def __init__(self, cfg: EconConfig, vocab_size: int, commit_dim: int, pad_id: int = 0, seed: int = 0):
        self.cfg = cfg
        net = dict(vocab_size=vocab_size, hidden_dim=cfg.hidden_dim, belief_dim=cfg.belief_dim, heads=cfg.heads,
                   layers=cfg.layers, max_len=cfg.obs_len, pad_id=pad_id)
        self.beliefs = M.BeliefNetworks(cfg.n_agents, net, shared=cfg.shared)
        self.encoder = M.BeliefEncoder(cfg.belief_dim, cfg.heads)
        self.mixer = M.Mixer(cfg.n_agents, commit_dim, cfg.mixing_dim, cfg.feature_dim, cfg.hyper_hidden)
        N = cfg.n_agents

        @jax.jit
        def init(key):
            k1, k2, k3 = jax.random.split(key, 3)
            return dict(beliefs=self.beliefs.init(k1, jnp.ones((1, N, cfg.obs_len), jnp.int32))["params"],
                        encoder=self.encoder.init(k2, jnp.zeros((1, N, cfg.belief_dim)))["params"],
                        mixer=self.mixer.init(k3, jnp.zeros((1, N)), jnp.zeros((1, N, 2)),
                                              jnp.zeros((1, cfg.belief_dim)))["params"])
        params = init(jax.random.key(seed))
        self.tx = optax.chain(optax.clip_by_global_norm(cfg.clip), optax.adam(cfg.lr))
        self.state = dict(params=params, target=params, step=jnp.int32(0),
                          opt={k: self.tx.init(v) for k, v in params.items()})
        self.act = jax.jit(self._act)
        self.train_step = jax.jit(self._train_step)

    # ------------------------------------------------------------------ forward passes
    def _act(self, params, obs_BNL):
        out = self.beliefs.apply({"params": params["beliefs"]}, obs_BNL)
        out["group"] = self.encoder.apply({"params": params["encoder"]}, out["belief"])
        return out

    def _losses(self, params, target, batch):
        """Each group's own loss, with the gradient of each cut off from the other groups (the
        reference steps three optimizers, each on its own loss), so that the gradient of their
        sum w.r.t. group k is the gradient of loss k alone."""
        cfg, sg = self.cfg, jax.lax.stop_gradient
        enc_live = lambda b: self.encoder.apply({"params": params["encoder"]}, b)  # noqa: E731
        enc_frozen = lambda b: self.encoder.apply({"params": sg(params["encoder"])}, b)  # noqa: E731
        s1 = self.beliefs.apply({"params": params["beliefs"]}, batch["obs"])
        b1 = s1["belief"]
        b2, g2, sweeps = L.bne_refine(b1, enc_frozen, max_iters=cfg.bne_max_iters, tol=cfg.bne_tol,
                                      rate=cfg.bne_rate)
        actions = jnp.stack([s1["temperature"], s1["top_p"]], -1)
        mixed = self.mixer.apply({"params": params["mixer"]}, sg(s1["q"]), sg(actions), sg(g2))
        # target networks on the next observation (single-turn tasks: masked by terminated)
        t1 = self._act(target, batch["next_obs"])
        t_actions = jnp.stack([t1["temperature"], t1["top_p"]], -1)
        q_next = self.mixer.apply({"params": target["mixer"]}, t1["q"], t_actions, t1["group"])["q_tot"]
        y = L.td_target_in(batch["reward"], sg(q_next), cfg.gamma, batch["terminated"])
        l_mix, m_mix = L.mix_loss(mixed["q_tot"], sg(s1["q"]), mixed["features_sd"], batch["commit_emb"], y,
                                  batch["reward"], batch["terminated"], batch["mask"], gamma=cfg.gamma,
                                  lambda_sd=cfg.lambda_sd, lambda_m=cfg.lambda_m,
                                  reference_broadcast=cfg.reference_broadcast)
        # stage-2 Q: the reference recomputes it from the observation tokens (with no padding mask,
        # so it differs on padded inputs: docs/methods/econ.md quirk 6); ours is stage 1's
        l_bel, m_bel = L.belief_loss(b1, b2, s1["q"], s1["q"], y, batch["mask"], stage2_weight=cfg.stage2_weight)
        g1_live, g2_live = enc_live(sg(b1)), enc_live(sg(b2))
        l_enc, m_enc = L.encoder_loss(g1_live, g2_live, enc_live(sg(b1)), g2_live)
        total = l_bel + l_enc + l_mix
        return total, {**m_mix, **m_bel, **m_enc, "q_tot_mean": mixed["q_tot"].mean(), "bne_sweeps": sweeps,
                       "temperature_mean": actions[..., 0].mean(), "top_p_mean": actions[..., 1].mean()}

    def _train_step(self, state, batch):
        params = state["params"]
        grads, metrics = jax.grad(self._losses, has_aux=True)(params, state["target"], batch)
        new_params, new_opt = {}, {}
        for group in ("beliefs", "encoder", "mixer"):  # three optimizers, each clipped on its own
            upd, new_opt[group] = self.tx.update(grads[group], state["opt"][group], params[group])
            new_params[group] = optax.apply_updates(params[group], upd)
        step = state["step"] + 1
        copy = (step % self.cfg.target_every) == 0
        target = jax.tree.map(lambda n, t: jnp.where(copy, n, t), new_params, state["target"])
        return dict(params=new_params, target=target, step=step, opt=new_opt), metrics

    def update(self, batch) -> dict:
        """One training step on ``batch`` (see ``make_batch``); returns the metrics (floats)."""
        self.state, metrics = self.train_step(self.state, batch)
        return {k: float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------- the frozen LMs

def encode_obs(tokenizer, texts: Sequence[str], length: int, n_agents: int) -> np.ndarray:
    """[B, N, L] observation ids: bos + the text's bytes, right-padded with pad (cut at L)."""
    rows = np.full((len(texts), length), tokenizer.pad_id, np.int32)
    for i, t in enumerate(texts):
        ids = ([tokenizer.bos_id] + list(tokenizer.encode(t)))[:length]
        rows[i, :len(ids)] = ids
    return np.repeat(rows[:, None], n_agents, axis=1)


def sample_answers(model_cfg, params, tokenizer, prompts: Sequence[str], temperatures, top_ps, key,
                   max_new: int) -> list[str]:
    """One continuation per prompt, prompt i at (temperatures[i], top_ps[i]), by the codebase's
    KV-cache decoding (``inference.decode.generate``, whose temperature and top-p are traced
    scalars: one compiled program serves every call). Rows that share (T, p) are decoded in one
    batch; otherwise one call per row."""
    T, P = np.asarray(temperatures, np.float64), np.minimum(np.asarray(top_ps, np.float64), 1.0)
    ids = [[tokenizer.bos_id] + list(tokenizer.encode(p)) for p in prompts]
    groups = [list(range(len(prompts)))] if np.all(T == T[0]) and np.all(P == P[0]) else \
        [[i] for i in range(len(prompts))]
    out = [""] * len(prompts)
    for g, rows in enumerate(groups):
        res = decode.generate(model_cfg, params, [ids[i] for i in rows], key=jax.random.fold_in(key, g),
                              max_new_tokens=max_new, temperature=float(T[rows[0]]), top_p=float(P[rows[0]]),
                              stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
        for j, i in enumerate(rows):
            toks = [int(x) for x in res.tokens[j, :res.lengths[j]] if int(x) != tokenizer.eos_id]
            out[i] = tokenizer.decode(toks)
    return out


def sample_team(executors: Sequence[tuple], tokenizer, prompts: Sequence[str], actions_BN2, key, max_new: int,
                parse: Callable) -> list[list]:
    """Parsed answers [B][N]: executor i = (model_cfg, params) samples each prompt once at
    actions[:, i] = (T, p)."""
    a = np.asarray(actions_BN2)
    texts = [sample_answers(mc, mp, tokenizer, prompts, a[:, i, 0], a[:, i, 1], jax.random.fold_in(key, i), max_new)
             for i, (mc, mp) in enumerate(executors)]
    return [[parse(texts[i][b]) for i in range(len(executors))] for b in range(len(prompts))]


class FrozenLM:
    """A frozen decoder with jitted helpers: ``logprob(prompts, continuations)`` (summed log-prob
    of each continuation after [bos] + prompt) and ``embed(texts)`` (mean over real tokens of the
    last layer's ``resid_post``), both at one padded length ``length``."""

    def __init__(self, model_cfg, params, tokenizer, length: int):
        self.cfg, self.params, self.tok, self.length = model_cfg, jax.lax.stop_gradient(params), tokenizer, length
        self.model = build_model(model_cfg)
        point = f"layer_{model_cfg.num_layers - 1}/resid_post"

        @jax.jit
        def _lp(params, ids, mask):
            logits = self.model.apply({"params": params}, ids).astype(jnp.float32)
            lp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), ids[:, 1:, None], -1)[..., 0]
            return jnp.sum(lp * mask[:, 1:], -1)

        @jax.jit
        def _emb(params, ids):
            h = hooks.capture(self.model, params, ids, points=[point])[point].astype(jnp.float32)
            real = (ids != tokenizer.pad_id)[..., None]
            return jnp.sum(h * real, 1) / jnp.maximum(real.sum(1), 1)
        self._lp, self._emb = _lp, _emb

    def _ids(self, texts):
        ids = np.full((len(texts), self.length), self.tok.pad_id, np.int32)
        for i, t in enumerate(texts):
            x = ([self.tok.bos_id] + list(self.tok.encode(t)))[:self.length]
            ids[i, :len(x)] = x
        return ids

    def logprob(self, prompts: Sequence[str], continuations: Sequence[str]) -> np.ndarray:
        ids = self._ids([p + c for p, c in zip(prompts, continuations)])
        mask = np.zeros(ids.shape, np.float32)
        for i, (p, c) in enumerate(zip(prompts, continuations)):
            start = 1 + len(self.tok.encode(p))
            mask[i, start:min(start + len(self.tok.encode(c)), self.length)] = 1.0
        return np.asarray(self._lp(self.params, ids, mask))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return np.asarray(self._emb(self.params, self._ids(texts)))


# ---------------------------------------------------------------------- aggregation and rewards

def majority_vote(answers: Sequence) -> object:
    """The most common non-None answer (ties: the one seen first); None if none parsed."""
    valid = [a for a in answers if a is not None]
    if not valid:
        return None
    counts = collections.Counter(valid)
    best = max(counts.values())
    return next(a for a in valid if counts[a] == best)


def commit(coordinator: FrozenLM, prompts: Sequence[str], answers: Sequence[Sequence]) -> list:
    """The coordinator's commitments: per question, the distinct parsed answer with the highest
    coordinator log-prob after the prompt (ties: first seen; None when no answer parsed). All
    B x N candidates are scored in one fixed-shape batch (missing ones repeat the first)."""
    n = max(len(a) for a in answers)
    cands = [list(dict.fromkeys(x for x in a if x is not None)) for a in answers]
    flat_p, flat_c = [], []
    for p, c in zip(prompts, cands):
        row = (c or ["0"]) + [(c or ["0"])[0]] * (n - len(c or ["0"]))
        flat_p += [p] * n
        flat_c += [str(x) for x in row]
    scores = coordinator.logprob(flat_p, flat_c).reshape(len(prompts), n)
    return [c[int(np.argmax(sc[:len(c)]))] if c else None for c, sc in zip(cands, scores)]


def toy_rewards(answers: Sequence, commitment, truth) -> dict:
    """The reference's reward parts on the toy task (module docstring, step 4)."""
    n = len(answers)
    ts = float(commitment is not None and commitment == truth)
    al = float(sum(a == commitment for a in answers if a is not None) / n) if commitment is not None else 0.0
    distinct = len({a for a in answers}) / n
    cc = 0.3 * ts + 0.3 * distinct + 0.2 * al
    return dict(al=al, ts=ts, cc=cc, reward=float(L.reward(al, ts, cc)))


def make_batch(obs_BNL, rewards, commit_emb) -> dict:
    """A single-turn training batch: next observation = the observation, terminated = mask = 1."""
    B = obs_BNL.shape[0]
    return dict(obs=jnp.asarray(obs_BNL), next_obs=jnp.asarray(obs_BNL), reward=jnp.asarray(rewards, jnp.float32),
                terminated=jnp.ones((B,), jnp.float32), mask=jnp.ones((B,), jnp.float32),
                commit_emb=jnp.asarray(commit_emb, jnp.float32))


def run_round(harness: Harness, executors: Sequence[tuple], coordinator: FrozenLM, embedder: FrozenLM,
              tokenizer, prompts: Sequence[str], truths: Sequence, parse: Callable, key, *, max_new: int,
              updates: int = 1) -> dict:
    """One ECON round on a batch of questions (module docstring): the belief networks' actions,
    one sample per executor, the coordinator's commitment, the rewards and ``updates`` training
    steps on the round's batch. Returns per-question ``answers`` [B][N], ``commitment``,
    ``rewards``, ``actions`` [B, N, 2] and the training ``metrics`` (one dict per step)."""
    cfg = harness.cfg
    obs = encode_obs(tokenizer, prompts, cfg.obs_len, cfg.n_agents)
    out = harness.act(harness.state["params"], jnp.asarray(obs))
    actions = np.stack([np.asarray(out["temperature"]), np.asarray(out["top_p"])], -1)
    answers = sample_team(executors, tokenizer, prompts, actions, key, max_new, parse)
    commitments = commit(coordinator, prompts, answers)
    rewards = [toy_rewards(a, c, t) for a, c, t in zip(answers, commitments, truths)]
    emb = embedder.embed([p + ("" if c is None else str(c)) for p, c in zip(prompts, commitments)])
    batch = make_batch(obs, [r["reward"] for r in rewards], emb)
    metrics = [harness.update(batch) for _ in range(updates)]
    return dict(answers=answers, commitment=commitments, rewards=rewards, actions=actions, metrics=metrics)
