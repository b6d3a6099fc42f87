"""TGDPO vs DPO on the shared sentiment testbed, or on the token-additive gold world
(docs/methods/tgdpo.md).

  python -m experiments.tgdpo_vs_dpo --workdir=DIR [--preset=tiny|default|additive_tiny|additive]
      [--testbed=TESTBED_DIR]

See ``__main__.py`` for what it runs and writes.
"""
