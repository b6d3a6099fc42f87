"""A sparse autoencoder on one hook point of a trained language model (task ``sae``; Feature
Flow's SAE stage, docs/methods/feature_flow.md).

Run (the source: a configs/lm.py run with the same preset, e.g. runs/lm_small):
  python -m icml_jax.main --config=configs/sae.py:small --workdir=runs/sae_l2_resid \\
      --config.sae.source=runs/lm_small --config.sae.point=layer_2/resid_post

``config.sae``:
  source          the LM's training workdir (required): model config from its config.json, params
                  from its newest checkpoint; same tokenizer as config.data.tokenizer
  point           the hook point read, ``layer_<i>/<point>`` (models/hooks.py: resid_pre, attn_out,
                  mlp_hidden, mlp_out, resid_post; attn_heads is not [B, T, width])
  latents         M, the number of features
  activation      topk | jumprelu
  k               topk: latents kept per token
  aux_k, aux_coef topk: the AuxK loss (Gao et al. 2024) over the latents dead in the batch, its
                  k_aux (0: off) and coefficient (1/32)
  l0_coef         jumprelu: λ of the L0 penalty λ·||z||_0 per token
  bandwidth       jumprelu: ε of the rectangle-kernel pseudo-derivative
  init_threshold  jumprelu: every θ at the start
  pre_bias        subtract b_dec before the encoder (off: the spec's z = σ(W_enc h + b_enc))

config.model and config.data are the source's preset in configs/lm.py (the rows the SAE reads are
those an lm run of this config reads; config.model only describes the source).

Presets: ``tiny`` (tests; configs/lm.py:tiny's model), ``small`` (configs/lm.py:small's model;
the spec's CPU setting scaled to d = 256: 2048 latents, k = 32, 1000 steps x 4096 tokens).
"""
import ml_collections

from icml_jax.config_utils import sibling_config

lm = sibling_config(__file__)

SAE = dict(source="", point="layer_1/resid_post", latents=256, activation="topk", k=16, aux_k=0,
           aux_coef=1.0 / 32, l0_coef=1e-3, bandwidth=1e-3, init_threshold=1e-3, pre_bias=False)

PRESETS = {
    "tiny": dict(
        model=lm.PRESETS["tiny"]["model"], data=lm.PRESETS["tiny"]["data"],
        sae=dict(point="layer_1/resid_post", latents=64, k=4),
        train=dict(steps=8, batch_size=8, lr=1e-2, warmup_steps=1, log_every=4, eval_every=8,
                   eval_batches=2, checkpoint_every=8, progress=False, async_checkpoint=False),
    ),
    "small": dict(
        model=lm.PRESETS["small"]["model"], data=lm.PRESETS["small"]["data"],
        sae=dict(point="layer_2/resid_post", latents=2048, k=32, aux_k=128),
        train=dict(steps=1000, batch_size=16, lr=1e-3, warmup_steps=50, eval_every=250,
                   checkpoint_every=250),
    ),
}


def get_config(preset: str = "small") -> ml_collections.ConfigDict:
    """``configs/lm.py``'s base with task="sae", ``config.sae`` and no weight decay."""
    return lm.preset_config(PRESETS, preset, default="small", where="configs/sae.py",
                            sections={"sae": SAE},
                            base={"task": "sae", "train": {"samples": 0, "weight_decay": 0.0}})
