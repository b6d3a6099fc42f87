"""FoPE length-generalisation experiment; run ``python -m experiments.fope_length --help``."""
