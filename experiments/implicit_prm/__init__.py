"""Implicit PRM reproduction on the arithmetic testbed (specs/implicit_prm.md §6); see __main__."""
