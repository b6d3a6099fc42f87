"""TGDPO vs DPO on the shared sentiment testbed (docs/methods/tgdpo.md).

  python -m experiments.tgdpo_vs_dpo --workdir=DIR [--preset=tiny|default] [--testbed=TESTBED_DIR]

See ``__main__.py`` for what it runs and writes.
"""
