"""lrmoe_kernels: the Triton kernels behind lrmoe's custom ops (installed under this name so it cannot clash).

Modules: ``scoring`` (pair scores in one pass over g), ``selection`` (per-group top-quota and systematic-sampling
compaction), ``grouped_gemm`` (gather-fused grouped GEMM and grouped weight gradient), ``offload`` (a row gather
that reads pinned host memory), ``token_rows`` (per-token sums and dot products over K gathered rows), ``swiglu``
(the SwiGLU with ||phi||^2, and its backward), ``routing`` (the router's top-k expert ids). Each module
holds the @triton.jit kernels and their launchers, nothing else; lrmoe.ops registers them as the CUDA kernels of
the custom ops, whose CPU kernels are the pure-PyTorch references. ``launch`` is how every launcher starts a
kernel, so that torch.compile can record the launches (through torch.library.wrap_triton) instead of running them.
"""
