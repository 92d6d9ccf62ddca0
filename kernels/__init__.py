"""lrmoe_kernels: the Triton kernels behind lrmoe's custom ops (installed under this name so it cannot clash).

Empty for now: the reference implementations in lrmoe.ops run on every device; the Triton kernels (scoring,
selection, gather-fused grouped GEMM, fused SwiGLU epilogue) arrive with the performance work.
"""
