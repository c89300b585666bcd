"""The measurement settings `elastor profile` uses unless told otherwise (torch-free, for --help)."""

# Timed runs per shape after the warm-up runs: the median of 20 is steady to a few percent on an
# idle CPU, and a gpt-tiny profile of every default shape still takes a few seconds.
REPEATS = 20
WARMUP = 3
# One intra-op thread on CPU: a CPU "device" of the runtime is one process, and with one thread a
# measurement on a busy machine slows down gracefully; with two threads on two busy cores, OpenMP's
# barriers made medians of the same layer differ by up to 1.7x between back-to-back profiles.
CPU_THREADS = 1
