"""FP8 kernels for LoKA: quantization recipes, GEMM backends, the fused Mods kernel, LoKALinear and Dispatch.

Importing this package never imports triton, torchao or fbgemm: backends load them lazily.
"""
