"""BT vs BT+BSR reward models on the shared preference testbed (specs/bsr.md §6).

Run with ``python -m experiments.bsr_robustness --workdir=DIR [--preset=tiny|default]``; see
``__main__.py``.
"""
