"""Per-paper small-scale reproductions: ``python -m experiments.NAME --workdir=DIR [--preset=tiny|default]``."""
