"""Where a step's GPU time goes: kernel kinds by name (``kernels``) and a profiler trace split per training step
(``trace_split``), as train.py's profiler callback writes it and the benchmarks record it."""
