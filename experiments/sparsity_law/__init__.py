"""Sparsing Law experiment (ReLU-GLU vs SiLU-GLU activation sparsity vs tokens); run ``python -m experiments.sparsity_law --help``."""
