"""Activation sparsity (Luo, Song et al., *Sparsing Law*, ICML 2025; ``docs/methods/
sparsity_cett.md``): CETT, per-layer thresholds, CETT-PPL-p%, baselines and the sparsing laws.

  cett.py      CETT on arrays and the reference's threshold search
  evaluate.py  collecting a model's MLP activations, sparse evaluation, CETT-PPL-p%, baselines
  laws.py      the ReLU / SiLU sparsing laws and their fits

  layers = collect_mlp(model, params, batch)              # [(acts_NF, w_down_FD)] per layer
  t = threshold_for_cett(*layers[0], 0.2)                 # the reference's grid + binary search
  res = cett_ppl_search(model, params, batches, p=1.0)    # res["activation_ratio"], res["thresholds"]
  c = cett_ppl_search_checkpoints(model, [p1, p2], batches)["cett"]  # one CETT per run (authors)
  sparsity_at_cett(model, p0, batches, c)["activation_ratio"]       # applied to any checkpoint
  fit_relu_law(D_billions, ratios)                        # {"alpha", "b", "c", "A0"}

Every name is importable from ``icml_jax.analysis.sparsity`` itself.
"""
from icml_jax.analysis.sparsity.cett import (GRID_SIZE, LayerStats, QUANTILE, activation_ratio_at,
                                             cett, check_gated, kept_neurons, neuron_output_norms,
                                             threshold_for_cett, torch_linspace)  # noqa: F401
from icml_jax.analysis.sparsity.evaluate import (Batch, CettProbe, MLPSites, activation_ratio,
                                                 cett_ppl_search, cett_ppl_search_checkpoints, collect_gate_up, collect_mlp,
                                                 collect_mlp_batches, default_sites, dense_loss,
                                                 fat_baseline, predictor_data, predictor_tree,
                                                 sparse_apply, sparse_eval,
                                                 sparse_logits, sparsity_at_cett, thresholds_tree,
                                                 topk_baseline)  # noqa: F401
from icml_jax.analysis.sparsity.laws import (fit_relu_law, fit_silu_law, relu_law, silu_law)  # noqa: F401
