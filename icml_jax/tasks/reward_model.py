"""``reward_model``: a Bradley-Terry reward model (+ BSR, docs/methods/bsr.md) trained on preference pairs.

The model is ``icml_jax.models.reward.RewardModel`` (the decoder plus a scalar ``score`` head read
at the last real token of each sequence); the loss is ``icml_jax.losses.reward_loss`` with the
``config.loss`` keys below. BSR's per-device mean is taken over the rows each data shard holds
(``num_shards`` = mesh data * fsdp; with gradient accumulation each micro-batch has its own
penalty), as the reference computes it under one-process-per-GPU training.

Logged (means over pairs): ``accuracy``, ``margin``, ``rewards/{chosen,rejected,mean,std}``,
``loss/{pair,center,bsr}``, the final hidden-state norm at the scoring token
``hidden_norm/{mean,std}`` (its dispersion is what the BSR paper blames for over-optimisation),
the same before the final norm ``residual_norm/{mean,std}`` (a final RMSNorm pins the former) and
the score-head norm ``score_norm``. Batch statistics (std) are per (micro-)batch, averaged.

config.loss: variant (bt | hinge | normalized | eurus), margin, center_coef, bsr_lambda,
bsr_scale_by_batch, bsr_reduce (local | global), reward_position (``score_index``: last |
last_response_token).
"""
import jax
import jax.numpy as jnp
import ml_collections

from icml_jax.losses import reward_loss, weighted_mean
from icml_jax.models.reward import build_reward_model
from icml_jax.tasks import TASKS
from icml_jax.tasks.pairs import PairTask, as_sums, batched_apply, flat


REWARD_POSITIONS = ("last", "last_response_token")


def score_index(tokens_NT, lengths_N, eos_id: int, position: str = "last", response_mask_NT=None):
    """The slot the reward is read at, int32 [N]. ``last``: the last real token (``lengths - 1``:
    the appended eos with ``config.data.add_eos``; TRL's last non-padding token).
    ``last_response_token``: the response's own last token, i.e. one slot earlier when the row
    ends with an eos (a backbone trained on packed LM rows has seen eos only as a target, so its
    hidden state there hardly depends on the response; docs/methods/bsr.md). With
    ``response_mask_NT`` it never steps back onto the prompt (an empty response: its eos)."""
    if position not in REWARD_POSITIONS:
        raise ValueError(f"unknown config.loss.reward_position {position!r}; choose one of "
                         f"{REWARD_POSITIONS}")
    last_N = jnp.maximum(lengths_N - 1, 0)
    if position == "last":
        return last_N
    ends_with_eos = jnp.take_along_axis(tokens_NT, last_N[:, None], axis=1)[:, 0] == eos_id
    back = ends_with_eos & (last_N > 0)
    if response_mask_NT is not None:
        prev_N = jnp.maximum(last_N - 1, 0)
        back &= jnp.take_along_axis(response_mask_NT, prev_N[:, None], axis=1)[:, 0] > 0
    return jnp.where(back, last_N - 1, last_N)


@TASKS.register("reward_model")
class RewardModelTask(PairTask):
    pretrained_key = "backbone"  # config.train.init_from (an LM workdir) loads the decoder here
    can_sample = False

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        super().__init__(config, context)
        self.model = build_reward_model(config.model)
        # runs saved before the key existed read at the last token
        self.reward_position = config.loss.get("reward_position", "last")
        score_index(jnp.zeros((1, 2), jnp.int32), jnp.ones(1, jnp.int32), 0,
                    self.reward_position)  # fail on an unknown position now
        self._score = jax.jit(self._score_rows, static_argnums=2)
        L = config.loss
        # fail on a bad loss setting now, not at the first traced step
        reward_loss(jnp.zeros(self.num_shards), jnp.zeros(self.num_shards), variant=L.variant,
                    bsr_lambda=L.bsr_lambda, bsr_reduce=L.bsr_reduce, num_shards=self.num_shards)

    def init_params(self, rng, batch):
        b = flat(batch["inputs"])
        return self.model.init(rng, b, flat(batch["positions"]), flat(batch["segment_ids"]),
                               flat(batch["lengths"]) - 1)["params"]

    def apply(self, params, tokens_NT, positions_NT, segment_ids_NT, lengths_N,
              response_mask_NT=None, with_residual: bool = False):
        """(rewards [N], final hidden states at the scoring token [N, F]) of single sequences;
        ``with_residual`` adds the residual stream's norm there before the final norm [N]."""
        index_N = score_index(tokens_NT, lengths_N, self.tokenizer.eos_id, self.reward_position,
                              response_mask_NT)
        if not with_residual:
            return self.model.apply({"params": params}, tokens_NT, positions_NT, segment_ids_NT,
                                    index_N)
        (r_N, h_NF), diag = self.model.apply({"params": params}, tokens_NT, positions_NT,
                                             segment_ids_NT, index_N, mutable=["diagnostics"])
        res_NT = diag["diagnostics"]["backbone"]["residual_norm"][0]
        return r_N, h_NF, jnp.take_along_axis(res_NT, index_N[:, None], axis=1)[:, 0]

    def loss(self, params, batch):
        L, t = self.config.loss, self.config.train
        B = batch["inputs"].shape[0]
        r, h, res = self.apply(params, flat(batch["inputs"]), flat(batch["positions"]),
                               flat(batch["segment_ids"]), flat(batch["lengths"]),
                               flat(batch["response_mask"]), with_residual=True)
        r_B2 = r.reshape(B, 2)
        w = batch["weight"]
        loss, m = reward_loss(r_B2[:, 0], r_B2[:, 1], variant=L.variant, margin=L.margin,
                              center_coef=L.center_coef, bsr_lambda=L.bsr_lambda,
                              bsr_scale_by_batch=L.bsr_scale_by_batch, bsr_reduce=L.bsr_reduce,
                              num_shards=self.num_shards,
                              per_device_batch=t.batch_size // (self.num_shards * t.grad_accum),
                              weights_B=w)
        w2 = jnp.repeat(w, 2)
        # the scoring token's norm after the final norm (what the head reads) and before it (the
        # residual stream, whose dispersion a final RMSNorm pins by construction)
        for name, x in (("hidden_norm", jnp.linalg.norm(h, axis=-1)), ("residual_norm", res)):
            mean = weighted_mean(x, w2)
            m[f"{name}/mean"] = mean
            m[f"{name}/std"] = jnp.sqrt(weighted_mean(jnp.square(x - mean), w2))
        m["score_norm"] = jnp.linalg.norm(params["score"].astype(jnp.float32))
        return as_sums(loss, m, w)

    def score(self, params, arrays: dict, batch_size: int = 64, with_residual: bool = False):
        """Rewards and hidden-state norms of single sequences (``encode_responses`` arrays):
        (rewards [N], hidden norms [N]) as float32 numpy; ``with_residual`` adds the residual
        stream's norm at the scoring token before the final norm [N] (a third array)."""
        keys = ("inputs", "positions", "segment_ids", "lengths", "response_mask")
        out = batched_apply(lambda b: self._score(params, b, with_residual),
                            {k: arrays[k] for k in keys}, batch_size)
        return (out[:, 0], out[:, 1]) + ((out[:, 2],) if with_residual else ())

    def _score_rows(self, params, b, with_residual=False):
        out = self.apply(params, b["inputs"], b["positions"], b["segment_ids"], b["lengths"],
                         b["response_mask"], with_residual=with_residual)
        r, h = out[:2]
        return jnp.stack([r, jnp.linalg.norm(h, axis=-1), *out[2:]], -1)

