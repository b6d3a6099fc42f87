"""Model compression: pruning masks, targeted low-rank refinement (TLR) and model-level pruning
(docs/methods/tlr_pruning.md). Works on our decoder's params, trained here or imported from HF."""
