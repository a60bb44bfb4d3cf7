"""LoKA Dispatch: per layer and per GEMM, the fastest FP8 backend that is accurate enough (timing of the candidates,
the choice, the plan and its file) and the conversion of a model by a plan.

Importing this package imports no submodule: import the one you need.
"""
