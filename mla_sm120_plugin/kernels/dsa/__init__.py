"""DeepSeek Sparse Attention kernels: one paged latent cache, top-k token slots per query token.

The layouts, to the byte, are :mod:`.layout`; packing and dequantization :mod:`.pack` (the NVFP4 rows
:mod:`.nvfp4`); the torch reference :mod:`.reference`; the Triton kernels :mod:`.triton` (exact) and
:mod:`.triton_fast` (fp8 MMAs), their shared parts :mod:`.triton_parts` and launch plans
:mod:`.plan`. The contract every kernel here keeps (shapes, dtypes, masking, LSE base) is
stated once, on :func:`mla_sm120_plugin.dispatch.forward.sparse_mla_forward`. Importing this package
imports neither torch nor triton.
"""
