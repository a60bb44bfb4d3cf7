"""Diagnostic benchmarks behind docs/kernels/README.md, run from the repository root as modules:
``python -m benchmarks.<name>`` (benchmarks/README.md lists them)."""
