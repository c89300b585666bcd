"""Solver: optimal heterogeneous plans for any set of healthy GPUs (torch-free)."""
