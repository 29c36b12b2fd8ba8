"""DeepSeek-V4 attention kernels: two paged caches in one call (a sliding window and a compressed
cache, each with its own slots, lengths and page size), a learned sink logit per head, q = K = V =
the whole 512-wide row.

The records, to the byte, are :mod:`.layout`; packing and dequantization :mod:`.pack`; the torch
reference :mod:`.reference`; the Triton kernel :mod:`.triton` and its launch plan :mod:`.plan`
(pure Python); the NVFP4 record's writers :mod:`.nvfp4_writer`. Importing this package imports neither torch nor triton.
"""
