"""``implicit_prm``: an implicit process reward model trained with the CE objective
(docs/methods/implicit_prm.md). The DPO objective on (correct, incorrect) pairs of one problem is the
``preference`` task with ``config.loss.type="sigmoid"`` and ``beta=0.05``: one implementation of
DPO for both papers.

Data: TRL's unpaired JSONL (``{"prompt", "completion", "label"}``, label = the final answer is
right; ``icml_jax.data.preference.read_unpaired_jsonl``), tokenised as single sequences. The
reward is r = beta * sum over the completion's tokens of log pi - log ref, with pi the trained
decoder (from ``config.train.init_from``) and ref the frozen generator (``config.loss.reference``,
"" = ``init_from``), whose per-token log-probs are computed once and cached in the batches as
``ref_logps``. Loss: ``icml_jax.losses.implicit_prm.ce_loss`` (BCE of sigma(r); logs clamped at
``config.loss.bce_log_clamp``, the reference's -100; 0 = no clamp). Logged: ``accuracy``
((r > 0) == label), ``rewards/correct``, ``rewards/incorrect``.

Step rewards for scoring come from the trained model with ``icml_jax.losses.implicit_prm``
(``token_log_ratios`` -> ``prefix_values`` -> ``step_rewards`` -> ``aggregate``); see
``experiments/implicit_prm``.
"""
import jax.numpy as jnp
import ml_collections
import numpy as np

from icml_jax.data import preference as pref_data
from icml_jax.losses import implicit_prm as ip
from icml_jax.models import build_model
from icml_jax.tasks import TASKS
from icml_jax.tasks.pairs import PairTask, as_sums


@TASKS.register("implicit_prm")
class ImplicitPRMTask(PairTask):
    example_shape = ()
    loss_unit = "responses"
    data_format = "prompt/completion/label per line, TRL's unpaired format"

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        super().__init__(config, context)
        self.tokens_per_unit = config.data.seq_len
        L = config.loss
        if not L.beta > 0:
            raise ValueError(f"config.loss.beta must be > 0, got {L.beta}")
        self.model = build_model(config.model)
        reference = L.reference or config.train.init_from
        if not reference:
            raise ValueError("config.task='implicit_prm' needs the frozen reference (the "
                             "generator): set config.train.init_from or config.loss.reference")
        self.cache_frozen_logps("ref_logps", reference, "config.loss.reference")

    def load(self, path: str):
        d = self.config.data
        rows = pref_data.read_unpaired_jsonl(path)
        arrays, stats = pref_data.encode_responses(
            [r["prompt"] for r in rows], [r["completion"] for r in rows], self.tokenizer,
            d.seq_len, max_prompt_len=d.max_prompt_len, add_eos=d.add_eos)
        arrays["label"] = np.asarray([r["label"] for r in rows], np.float32)
        return arrays, stats

    def extra_dummies(self, batch_size: int):
        return {"label": jnp.zeros((batch_size,), jnp.float32)}

    def init_params(self, rng, batch):
        return self.model.init(rng, batch["inputs"], batch["positions"], batch["segment_ids"])["params"]

    def loss(self, params, batch):
        L = self.config.loss
        lp = self.token_logps(params, batch)
        lr = ip.token_log_ratios(lp, batch["ref_logps"], jnp.zeros(lp.shape[:1], jnp.int32),
                                 batch["response_mask"])
        r = ip.outcome_reward(lr, L.beta)
        loss, m = ip.ce_loss(r, batch["label"], log_clamp=L.bce_log_clamp or None,
                             weights_B=batch["weight"])
        return as_sums(loss, m, batch["weight"])
