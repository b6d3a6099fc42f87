"""Implicit PRM reproduction on the arithmetic testbed (docs/methods/implicit_prm.md); see __main__."""
