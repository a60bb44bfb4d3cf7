"""FP8 GEMMs for LoKA: the GEMM backends Dispatch chooses from, LoKALinear (a Linear whose three GEMMs each run on
its own backend) with its weight cache, and the shared quantization (reference math and Triton kernels, PDL).

Importing this package never imports triton, torchao or fbgemm: backends load them lazily.
"""
