"""BT vs BT+BSR reward models on the shared preference testbed (docs/methods/bsr.md).

Run with ``python -m experiments.bsr_robustness --workdir=DIR [--preset=tiny|default]``; see
``__main__.py``.
"""
