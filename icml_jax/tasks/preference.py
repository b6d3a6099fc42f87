"""``preference``: DPO-family training of a policy against a frozen reference, and TGDPO.

``config.loss.type`` selects the loss (``icml_jax.losses.preference``): ``sigmoid`` (DPO),
``robust``, ``hinge``, ``ipo`` or ``tgdpo``. The policy is the decoder; it starts from
``config.train.init_from`` (the SFT workdir). The frozen models are never held during training:
when the task is built, the reference (``config.loss.reference``, "" = ``config.train.init_from``)
and, for TGDPO, the guidance policy pi_r (``config.loss.guidance``: a workdir of a DPO run of this
task) score every training and validation pair once; their per-token log-probs (float32
[N, 2, T], aligned with the tokens) travel in the batches as ``ref_logps`` / ``guide_logps``.
This is TRL's ``precompute_ref_log_probs``, applied to both frozen models. Gradients reach only
the policy: the cached arrays are inputs, and the losses also stop their gradients.

config.loss: type, beta, label_smoothing, reference_free, ipo_average (IPO on mean per-token
log-probs, TRL's convention), tgdpo_alpha, tgdpo_weight_clip (() = unclipped, the reference; or
(lo, hi)), sft_weight (the reference's ``pref_ftx``: + weight * mean per-token NLL of the chosen
response), reference, guidance. Metrics use TRL's names (``rewards/chosen`` ...).
"""
import jax.numpy as jnp
import ml_collections

from icml_jax.losses import PREFERENCE_LOSSES, dpo_loss, sequence_logps, weighted_mean
from icml_jax.losses import tgdpo_loss
from icml_jax.models import build_model
from icml_jax.tasks import TASKS
from icml_jax.tasks.pairs import PairTask, as_sums, flat


@TASKS.register("preference")
class PreferenceTask(PairTask):

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        super().__init__(config, context)
        L = config.loss
        if L.type not in PREFERENCE_LOSSES:
            raise ValueError(f"unknown config.loss.type {L.type!r}: choose one of {PREFERENCE_LOSSES}")
        dpo_loss(jnp.zeros(1), jnp.zeros(1), jnp.zeros(1), jnp.zeros(1), beta=L.beta,
                 label_smoothing=L.label_smoothing)  # fail on bad values now
        self.model = build_model(config.model)
        reference = L.reference or config.train.init_from
        if not L.reference_free:
            if not reference:
                raise ValueError("config.loss.type=%r needs a frozen reference: set "
                                 "config.train.init_from (the SFT workdir) or config.loss.reference, "
                                 "or config.loss.reference_free=True" % L.type)
            self.cache_frozen_logps("ref_logps", reference, "config.loss.reference")
        if L.type == "tgdpo":
            if not L.guidance:
                raise ValueError("config.loss.type='tgdpo' needs the guidance policy pi_r: set "
                                 "config.loss.guidance to the workdir of a DPO run (config.loss.type="
                                 "'sigmoid') from the same SFT start")
            if L.reference_free:
                raise ValueError("TGDPO's token reward is a log-ratio against the reference: "
                                 "config.loss.reference_free must be False")
            self.cache_frozen_logps("guide_logps", L.guidance, "config.loss.guidance")

    def init_params(self, rng, batch):
        return self.model.init(rng, flat(batch["inputs"]), flat(batch["positions"]),
                               flat(batch["segment_ids"]))["params"]

    def loss(self, params, batch):
        L = self.config.loss
        B, _, T = batch["inputs"].shape
        lp = self.token_logps(params, {k: flat(batch[k]) for k in
                                        ("inputs", "positions", "segment_ids", "response_mask")})
        lp = lp.reshape(B, 2, T)
        mask, w = batch["response_mask"], batch["weight"]
        ref = batch["ref_logps"] if "ref_logps" in batch else jnp.zeros_like(lp)
        if L.type == "tgdpo":
            g = batch["guide_logps"]
            clip = tuple(L.tgdpo_weight_clip) or None
            loss, m = tgdpo_loss(lp[:, 0], lp[:, 1], ref[:, 0], ref[:, 1], g[:, 0], g[:, 1],
                                 mask[:, 0], mask[:, 1], beta=L.beta, alpha=L.tgdpo_alpha,
                                 weight_clip=clip, weights_B=w)
        else:
            avg = L.type == "ipo" and L.ipo_average
            seq = lambda x, i: sequence_logps(x[:, i], mask[:, i], average=avg)  # noqa: E731
            loss, m = dpo_loss(seq(lp, 0), seq(lp, 1), seq(ref, 0), seq(ref, 1), beta=L.beta,
                               loss_type=L.type, label_smoothing=L.label_smoothing,
                               reference_free=L.reference_free, weights_B=w)
        if L.sft_weight:
            nll = -sequence_logps(lp[:, 0], mask[:, 0], average=True)
            m["sft_loss"] = weighted_mean(nll, w)
            loss = loss + L.sft_weight * m["sft_loss"]
        return as_sums(loss, m, w)
