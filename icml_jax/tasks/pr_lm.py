"""``pr_lm``: next-token LM training with a precision-recall loss (docs/methods/precision_recall.md).

The ``lm`` task (same data, model and batches) with the objective picked by ``config.loss``:

  type        nll | pr_hinge   (icml_jax/losses/precision_recall.py; pr_hinge is the spec's
                                *unverified* candidate L_lambda = min(lambda,1) - min(lambda, q_y))
  pr_lambda   lambda > 0 (< 1 recall-oriented)
  pr_mix_nll  weight of an added NLL term (pr_hinge only)

The trainer's ``loss`` / ``eval_loss`` are the objective per token; the metrics ``token_nll``,
``pr_hinge`` (at ``pr_lambda``, also for NLL runs), ``q_target`` and ``saturated`` are logged for
every type (``eval_token_nll`` is the held-out NLL). ``config.train.z_loss`` is not supported here.

``sequence_logprobs`` scores whole strings exactly: log Q_T(x) = sum_t log softmax(logits_t / T)
[x_t] over the tokens of ``[bos] + bytes(x) + [eos]`` (the eos included), for several sampling
temperatures T at once. Each step normalises, so Q_T is a distribution over finite token strings
(up to the mass of strings that never end) and equals what temperature sampling generates.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from icml_jax.losses.logps import token_logprobs
from icml_jax.losses.precision_recall import check_pr_args, pr_loss
from icml_jax.tasks import TASKS
from icml_jax.tasks.lm import LMTask


def loss_settings(config: ml_collections.ConfigDict) -> dict:
    """``config.loss`` as pr_loss keywords, checked (ValueError names the bad key)."""
    if "loss" not in config:
        raise ValueError("task 'pr_lm' needs a config.loss section (type, pr_lambda, pr_mix_nll); "
                         "use configs/precision_recall.py")
    L = config.loss
    out = dict(loss_type=str(L.get("type", "nll")), pr_lambda=L.get("pr_lambda", 1.0),
               pr_mix_nll=L.get("pr_mix_nll", 0.0))
    check_pr_args(**out)
    out["pr_lambda"], out["pr_mix_nll"] = float(out["pr_lambda"]), float(out["pr_mix_nll"])
    return out


@TASKS.register("pr_lm")
class PRLMTask(LMTask):
    """Batches as for ``lm``; the loss is ``pr_loss`` summed over the target tokens."""

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        super().__init__(config, context)
        self.loss_kw = loss_settings(config)
        if float(config.train.get("z_loss", 0.0)):
            raise ValueError("task 'pr_lm' does not support config.train.z_loss; set it to 0")
        # eval_loss is the objective; a perplexity of it only means something for NLL
        self.reports_perplexity = self.loss_kw["loss_type"] == "nll"

    def loss(self, params, batch):
        """(objective sum, number of target tokens, metric sums)."""
        logits = self.model.apply({"params": params}, batch["inputs"], batch["positions"],
                                  batch["segment_ids"])
        w = (batch["segment_ids"] > 0).astype(jnp.float32)
        lsum, msums = pr_loss(logits, batch["targets"], w, reduction="sum", **self.loss_kw)
        correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32) * w
        msums["accuracy"] = correct.sum()
        return lsum, w.sum(), msums


def encode_strings(tokenizer, strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N, T + 1] int32 of [bos] + ids + [eos] right-padded with pad_id, lengths [N] = the
    number of predicted tokens, len(ids) + 1)."""
    enc = [tokenizer.encode(s) for s in strings]
    T = max(len(e) for e in enc) + 1
    toks = np.full((len(enc), T + 1), tokenizer.pad_id, np.int32)
    for i, e in enumerate(enc):
        toks[i, 0], toks[i, 1:len(e) + 1], toks[i, len(e) + 1] = tokenizer.bos_id, e, tokenizer.eos_id
    return toks, np.array([len(e) + 1 for e in enc], np.int32)


def sequence_logprobs(model, params, tokenizer, strings: Sequence[str],
                      temperatures: Sequence[float] = (1.0,), batch_size: int = 1024) -> np.ndarray:
    """log Q_T(x) [len(temperatures), N] float64 (module docstring)."""
    temps = [float(t) for t in temperatures]
    if not temps or any(not t > 0 for t in temps):
        raise ValueError(f"temperatures must be > 0, got {list(temperatures)}")
    if not len(strings):
        return np.zeros((len(temps), 0))
    toks, lengths = encode_strings(tokenizer, strings)
    inv_t = jnp.asarray([1.0 / t for t in temps], jnp.float32)

    @jax.jit
    def score(p, toks_BT1, len_B):
        inp, tgt = toks_BT1[:, :-1], toks_BT1[:, 1:]
        T = inp.shape[1]
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), inp.shape)
        w = (pos < len_B[:, None]).astype(jnp.float32)
        logits = model.apply({"params": p}, inp, pos, jnp.ones_like(inp)).astype(jnp.float32)

        def one(it):  # one temperature at a time: memory of one [B, T, V] log-softmax
            return (token_logprobs(logits * it, tgt) * w).sum(-1)
        return jax.lax.map(one, inv_t)

    out = []
    for i in range(0, len(toks), batch_size):
        b, lb = toks[i:i + batch_size], lengths[i:i + batch_size]
        n = len(b)
        if n < batch_size and len(toks) > batch_size:  # keep one compiled shape
            b = np.concatenate([b, np.repeat(b[-1:], batch_size - n, 0)])
            lb = np.concatenate([lb, np.repeat(lb[-1:], batch_size - n)])
        out.append(np.asarray(score(params, jnp.asarray(b), jnp.asarray(lb)), np.float64)[:, :n])
    return np.concatenate(out, axis=1)
