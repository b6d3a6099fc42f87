"""RMT vs transformer and the residual-size sweep; run ``python -m experiments.rmt --help``."""
