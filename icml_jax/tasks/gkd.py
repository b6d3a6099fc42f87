"""``gkd``: Puzzle's global knowledge distillation of a child decoder from its parent
(Bercovich et al., ICML 2025; ``docs/methods/puzzle.md``, "Global distillation (GKD)").

The student is ``config.model`` (a Puzzle child: ``config.model.blocks`` gives each layer its
block, ``models/hetero.py``), initialised from ``config.train.init_from`` (the assembled child's
workdir). The teacher is the parent, another training workdir (``config.gkd.teacher``): its model
config comes from its ``config.json``, its newest params through ``context.restore_params``. It
must share the student's tokenizer, vocabulary, number of layers and width. The data are the
packed LM rows of ``tasks/lm.py`` (the same batches an ``lm`` run with this config reads). The
loss per valid token (``losses.distill.gkd_loss``):

  cosine_weight * sum_l (1 - cos(h_l^parent, h_l^child)) + kl_weight * KL(p_parent || p_child)
  + lm_weight * CE

with the metrics ``cosine``, ``kl``, ``ce`` (the student's NLL, logged whatever lm_weight) and
``accuracy``. The loss is not an NLL, so no perplexity is reported (``eval_ce`` is the CE).

How the teacher forward reaches the jitted step. The trainer jits ``task.loss(params, batch)``
with the student's params and the batch as its only arguments. Teacher params closed over by
``loss`` would be constants of the traced program, and this JAX (0.10) embeds closed-over arrays
in the HLO as literals: a 1000x1000 float32 matrix makes an 8 MB module, so a real parent would
make compiles huge and slow. Putting the teacher into the train state instead would give it
optimizer moments, weight decay and a place in every checkpoint. So the teacher runs beside the
step: ``train_iterator`` wraps the LM rows and adds to each batch, with one jitted teacher forward
(params as an argument, on this process's first device, where ``restore_params`` puts them):

  teacher_logits   float32 [B, T, V]   the parent's logits
  teacher_hidden   [B, L, T, D]        the parent's residual stream after each layer

The arrays stay on the device (no host round trip; the forward is dispatched asynchronously) and
enter the step like any batch array, so gradient accumulation splits them with the rows. The
wrapper's ``get_state`` / ``set_state`` are the rows' own: the teacher outputs are a function of
the rows, so a resumed run gets exactly the batches it would have had. ``eval_batches`` computes
them once and keeps them on the host. The cost is B*T*V floats per batch in device memory (fine
for this repo's vocabularies; a 128k vocabulary at B*T = 16k tokens is 8 GB), and on a host with
several devices the teacher runs on one of them.
"""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import ml_collections

from icml_jax.losses.distill import gkd_loss
from icml_jax.models import build_model
from icml_jax.tasks import TASKS
from icml_jax.tasks.lm import LMTask
from icml_jax.tasks.vocagnolm import (frozen_run_section, read_teacher_config,
                                      restore_run_params)

WEIGHTS = ("cosine_weight", "kl_weight", "lm_weight")


def stack_hidden(state, num_layers: int):
    """[B, L, T, D]: the ``hidden`` collection a decoder sowed (``h_0`` .. ``h_{L-1}``) stacked."""
    return jnp.stack([state["hidden"][f"h_{i}"][0] for i in range(num_layers)], axis=1)


def forward_with_hidden(model, params, batch):
    """(logits [B, T, V], hidden [B, L, T, D]) of an unscanned decoder on a packed-row batch."""
    logits, state = model.apply({"params": params}, batch["inputs"], batch["positions"],
                                batch["segment_ids"], mutable=["hidden"])
    return logits, stack_hidden(state, model.cfg.num_layers)


def check_gkd_config(config) -> None:
    """One-line ValueErrors naming the key, before anything is read or computed."""
    g = frozen_run_section(config, "gkd", "teacher", "the parent's")
    for k in WEIGHTS:
        v = g.get(k)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v >= 0:
            raise ValueError(f"config.gkd.{k}={v!r} must be a number >= 0")
    if not any(g[k] for k in WEIGHTS):
        raise ValueError(f"config.gkd.{'/'.join(WEIGHTS)} are all 0: nothing to train on")
    m = config.model
    if m.get("scan_layers", False) or m.get("residual", "standard") != "standard":
        raise ValueError("config.task='gkd' reads every layer's residual stream: set "
                         "config.model.scan_layers=False and config.model.residual='standard'")


def check_parent(config, parent) -> None:
    """The parent must read the same tokens into the same layers and width as the child."""
    key, c, p = f"config.gkd.teacher={config.gkd.teacher!r}", config, parent
    tok, ptok = c.data.tokenizer, p.data.tokenizer
    if (tok.type, tok.get("model_path", "")) != (ptok.type, ptok.get("model_path", "")):
        raise ValueError(f"{key}: its tokenizer ({ptok.type} {ptok.get('model_path', '')!r}) is not "
                         f"config.data.tokenizer ({tok.type} {tok.get('model_path', '')!r})")
    for name in ("vocab_size", "num_layers", "d_model"):
        if p.model[name] != c.model[name]:
            raise ValueError(f"{key}: its model.{name}={p.model[name]} differs from config.model."
                             f"{name}={c.model[name]}; a Puzzle child keeps the parent's")
    if p.model.get("scan_layers", False) or p.model.get("residual", "standard") != "standard":
        raise ValueError(f"{key}: the parent must be an unscanned standard decoder "
                         "(model.scan_layers=False, model.residual='standard')")
    if c.data.seq_len > p.model.max_seq_len:
        raise ValueError(f"config.data.seq_len={c.data.seq_len} is above the parent's "
                         f"max_seq_len={p.model.max_seq_len} ({key})")


class TeacherIterator:
    """The LM rows with the teacher's outputs added; its position is the rows' (exact resume)."""

    def __init__(self, rows, teacher):
        self.rows, self.teacher = rows, teacher

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.rows)
        return {**batch, **self.teacher(batch)}

    def get_state(self):
        return self.rows.get_state()

    def set_state(self, state) -> None:
        self.rows.set_state(state)


@TASKS.register("gkd")
class GKDTask(LMTask):
    """Packed LM rows plus ``teacher_logits`` float32 [B, T, V] and ``teacher_hidden`` [B, L, T, D]."""

    reports_perplexity = False

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        check_gkd_config(config)
        super().__init__(config, context)
        g = config.gkd
        self.parent_config = read_teacher_config(g.teacher, "config.gkd.teacher")
        check_parent(config, self.parent_config)
        self.teacher_params = restore_run_params(self.context, g.teacher, self.parent_config.model,
                                                 "config.gkd.teacher")
        self.teacher_model = build_model(self.parent_config.model)
        self._teacher_fn = jax.jit(lambda p, b: forward_with_hidden(self.teacher_model, p, b))
        self.weights = {k: float(g[k]) for k in WEIGHTS}

    def teacher_outputs(self, batch) -> dict:
        """{"teacher_logits", "teacher_hidden"} of a batch (device arrays)."""
        rows = {k: batch[k] for k in ("inputs", "positions", "segment_ids")}
        logits, hidden = self._teacher_fn(self.teacher_params, rows)
        return {"teacher_logits": logits, "teacher_hidden": hidden}

    def dummy_batch(self, batch_size: int, seq_len: int):
        out = super().dummy_batch(batch_size, seq_len)
        shapes = jax.eval_shape(self.teacher_outputs, out)
        out.update({k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()})
        return out

    def loss(self, params, batch):
        """(sum of the per-token GKD loss, valid tokens, sums of cosine / kl / ce / accuracy)."""
        logits, hidden = forward_with_hidden(self.model, params, batch)
        w = (batch["segment_ids"] > 0).astype(jnp.float32)
        return gkd_loss(logits, hidden, batch["teacher_logits"], batch["teacher_hidden"],
                        batch["targets"], w, **self.weights)

    def train_iterator(self, seed: int, shard=None):
        return TeacherIterator(super().train_iterator(seed, shard), self.teacher_outputs)

    def eval_batches(self, split: str = "validation", shard=None):
        return [{**b, **jax.device_get(self.teacher_outputs(b))}
                for b in super().eval_batches(split, shard)]
