"""NLL + temperature vs precision-recall losses; run ``python -m experiments.precision_recall --help``."""
