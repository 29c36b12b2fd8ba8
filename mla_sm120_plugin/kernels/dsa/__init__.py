"""DeepSeek Sparse Attention kernels: one paged latent cache, top-k token slots per query token.

The contract every kernel here keeps (shapes, dtypes, masking, LSE base) is stated once, on
:func:`mla_sm120_plugin.dispatch.forward.sparse_mla_forward`; the layouts, to the byte, in
:mod:`.layout`. Importing this package imports neither torch nor triton.
"""
