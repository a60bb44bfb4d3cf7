"""LoKA Mods: the fused Linear -> BlockNorm -> HardSwish layer (its op, Triton kernels, reference math, module and
model transform) and the BlockNorm / HardSwish layers models are built with.

Importing this package imports neither triton nor the kernels: import the submodule you need.
"""
