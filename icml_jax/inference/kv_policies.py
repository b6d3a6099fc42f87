"""The KV-cache eviction policies, where the inference code looks for them: the implementation is
``icml_jax/models/kv_policies.py`` (the decode cache in ``models/attention.py`` runs it, and models
may not import inference)."""
from icml_jax.models.kv_policies import (NEG_INF, POLICIES, KVPolicy, SlotState, choose_slot,  # noqa: F401
                                         init_state, morph_scores, observe, prefill_keep,
                                         prefill_scores, prefill_select, prefill_state, write)
