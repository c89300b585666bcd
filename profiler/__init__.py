"""Profiler: per-layer compute, memory and communication costs, measured or analytic."""
