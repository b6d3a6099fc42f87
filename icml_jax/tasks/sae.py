"""``sae``: a sparse autoencoder trained on one hook point of a frozen language model (Feature
Flow's SAE stage; docs/methods/feature_flow.md, spec /work/shared/specs/feature_flow.md).

The source is another training workdir (``config.sae.source``): its model config comes from its
``config.json`` (``read_teacher_config``), its newest params through ``context.restore_params``.
The data are the packed LM rows of ``tasks/lm.py`` (the batches an ``lm`` run with this config
reads); ``train_iterator`` adds to each batch

  activations  float32 [B, T, D]   the source's ``config.sae.point`` (``models/hooks.py``), zero
                                   at padding (the loss weighs tokens by segment_ids > 0)

computed by one jitted forward whose params are an argument (closed-over arrays would be HLO
constants in this JAX; see ``tasks/gkd.py``), on this process's first device, where
``restore_params`` puts them. The arrays stay on the device and enter the step like any batch
array. The wrapper's ``get_state`` / ``set_state`` are the rows' own: the activations are a
function of the rows, so a resumed run sees exactly the batches it would have had.
``eval_batches`` computes them once and keeps them on the host.

The trained module is ``models.sae.SAE`` (the params of the checkpoints are the SAE's); the loss
and metrics are ``losses.sae.sae_loss``. ``config.model`` is not the trained model: the trainer
still reads its max_seq_len (against data.seq_len) and its FLOPs estimate (the logged
model_tflops_per_sec is the LM's, not the SAE's).
"""
from __future__ import annotations

import functools
import numbers
import re

import jax
import jax.numpy as jnp
import ml_collections

from icml_jax.losses.sae import dead_latents, sae_loss
from icml_jax.models import build_model, hooks
from icml_jax.models.sae import ACTIVATIONS, SAE, topk_relu
from icml_jax.tasks import TASKS
from icml_jax.tasks.gkd import TeacherIterator
from icml_jax.tasks.lm import LMTask
from icml_jax.tasks.vocagnolm import (frozen_run_section, read_teacher_config,
                                      restore_run_params)

_POINT = re.compile(r"^layer_(\d+)/(\w+)$")


def _positive_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0


def _non_negative(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and v >= 0


def check_sae_config(config) -> tuple[int, str]:
    """One-line ValueErrors naming the key, before anything is read -> (layer, point name)."""
    s = frozen_run_section(config, "sae", "source", "the language model's")
    m = _POINT.match(str(s.get("point", "")))
    if not m or m.group(2) not in hooks.POINTS:
        raise ValueError(f"config.sae.point={s.get('point')!r}: use 'layer_<i>/<point>' with a "
                         f"point in {hooks.POINTS}")
    if s.activation not in ACTIVATIONS:
        raise ValueError(f"config.sae.activation={s.activation!r}: choose one of {ACTIVATIONS}")
    if not _positive_int(s.latents):
        raise ValueError(f"config.sae.latents={s.latents!r} must be a positive integer")
    if s.activation == "topk" and not (_positive_int(s.k) and s.k <= s.latents):
        raise ValueError(f"config.sae.k={s.k!r} must be an integer in [1, config.sae.latents="
                         f"{s.latents}]")
    if not (isinstance(s.aux_k, numbers.Integral) and 0 <= s.aux_k <= s.latents):
        raise ValueError(f"config.sae.aux_k={s.aux_k!r} must be an integer in [0, latents] "
                         "(0: no AuxK loss)")
    for key in ("aux_coef", "l0_coef"):
        if not _non_negative(s[key]):
            raise ValueError(f"config.sae.{key}={s[key]!r} must be a number >= 0")
    for key in ("bandwidth", "init_threshold"):
        if not (_non_negative(s[key]) and s[key] > 0):
            raise ValueError(f"config.sae.{key}={s[key]!r} must be a number > 0")
    return int(m.group(1)), m.group(0)


def check_source(config, source, layer: int) -> None:
    """The source must read this config's tokens and have the hooked layer."""
    key, s = f"config.sae.source={config.sae.source!r}", source
    tok, stok = config.data.tokenizer, s.data.tokenizer
    if (tok.type, tok.get("model_path", "")) != (stok.type, stok.get("model_path", "")):
        raise ValueError(f"{key}: its tokenizer ({stok.type} {stok.get('model_path', '')!r}) is "
                         f"not config.data.tokenizer ({tok.type} {tok.get('model_path', '')!r})")
    if s.model.get("scan_layers", False) or s.model.get("residual", "standard") != "standard":
        raise ValueError(f"{key}: hooks need an unscanned standard decoder (its model.scan_layers="
                         f"{s.model.get('scan_layers', False)}, model.residual="
                         f"{s.model.get('residual', 'standard')!r})")
    if layer >= s.model.num_layers:
        raise ValueError(f"config.sae.point={config.sae.point!r}: the source has "
                         f"{s.model.num_layers} layers (layer_0 .. layer_{s.model.num_layers - 1})")
    if config.data.seq_len > s.model.max_seq_len:
        raise ValueError(f"config.data.seq_len={config.data.seq_len} is above the source's "
                         f"max_seq_len={s.model.max_seq_len} ({key})")


def capture_point(model, point: str, params, rows: dict):
    """float32 [B, T, width] of ``model``'s hook ``point`` on packed rows, zero at padding."""
    acts = hooks.capture(model, params, rows["inputs"], rows["positions"], rows["segment_ids"],
                         points=[point])[point]
    return acts.astype(jnp.float32) * (rows["segment_ids"] > 0)[..., None]


def sae_objective(module: SAE, params, x, w, *, aux_k: int = 0, aux_coef: float = 1.0 / 32,
                  l0_coef: float = 0.0):
    """``losses.sae.sae_loss``'s (loss sum, tokens, metric sums) of ``module`` on activations
    ``x`` [..., D] with token weights ``w`` [...]: for topk with ``aux_k`` > 0 the AuxK term over
    the latents dead in this batch (their top-``aux_k`` pre-activations reconstruct the residual);
    for jumprelu the L0 penalty ``l0_coef``."""
    x_hat, z, d = module.apply({"params": params}, x, details=True)
    aux_hat = dead = None
    if module.activation == "topk" and aux_k:
        dead = dead_latents(z, w)
        aux_hat = topk_relu(jnp.where(dead, d["pre"], -jnp.inf), int(aux_k)) @ d["decoder"]
    return sae_loss(x, x_hat, z, w, l0=d["l0"], l0_coef=l0_coef if module.activation == "jumprelu" else 0.0,
                    aux_hat=aux_hat, aux_coef=aux_coef, dead=dead)


@TASKS.register("sae")
class SAETask(LMTask):
    """Packed LM rows plus ``activations`` float32 [B, T, D] of the source's hook point."""

    reports_perplexity = False
    can_sample = False

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        layer, self.point = check_sae_config(config)
        super().__init__(config, context)
        s = config.sae
        self.source_config = read_teacher_config(s.source, "config.sae.source")
        check_source(config, self.source_config, layer)
        self.source_model = build_model(self.source_config.model)
        self._capture_fn = jax.jit(functools.partial(capture_point, self.source_model, self.point))
        rows = super().dummy_batch(1, config.data.seq_len)
        try:  # the point exists in this source (a heterogeneous layout may lack a sub-block's)
            shape = jax.eval_shape(self.source_model.init, jax.random.key(0), rows["inputs"])
            width = jax.eval_shape(self._capture_fn, shape["params"], rows)
        except ValueError as e:
            raise ValueError(f"config.sae.point={s.point!r}: {e}") from e
        if len(width.shape) != 3:
            raise ValueError(f"config.sae.point={s.point!r} is {len(width.shape)}-D {width.shape}; "
                             "an SAE reads a [B, T, width] point (not attn_heads)")
        self.d_model = int(width.shape[-1])
        self.source_params = restore_run_params(self.context, s.source, self.source_config.model,
                                                "config.sae.source")
        self.model = SAE(d_model=self.d_model, latents=int(s.latents), activation=s.activation,
                         k=int(s.k), pre_bias=bool(s.pre_bias), bandwidth=float(s.bandwidth),
                         init_threshold=float(s.init_threshold))

    def activations(self, batch) -> dict:
        """{"activations": float32 [B, T, D]} of a batch (device arrays)."""
        rows = {k: batch[k] for k in ("inputs", "positions", "segment_ids")}
        return {"activations": self._capture_fn(self.source_params, rows)}

    def dummy_batch(self, batch_size: int, seq_len: int):
        out = super().dummy_batch(batch_size, seq_len)
        out["activations"] = jnp.zeros((batch_size, seq_len, self.d_model), jnp.float32)
        return out

    def init_params(self, rng, batch):
        return self.model.init(rng, batch["activations"])["params"]

    def loss(self, params, batch):
        """(Σ per-token SAE loss, valid tokens, sums of mse / l0 / fvu / dead [/ auxk])."""
        s = self.config.sae
        w = (batch["segment_ids"] > 0).astype(jnp.float32)
        return sae_objective(self.model, params, batch["activations"], w, aux_k=int(s.aux_k),
                             aux_coef=float(s.aux_coef), l0_coef=float(s.l0_coef))

    def train_iterator(self, seed: int, shard=None):
        return TeacherIterator(super().train_iterator(seed, shard), self.activations)

    def eval_batches(self, split: str = "validation", shard=None):
        return [{**b, **jax.device_get(self.activations(b))}
                for b in super().eval_batches(split, shard)]
