"""Kernel tests: one device, tolerances that scale with the values compared, and what a call touches.

Kernel tests run where the kernels really run: on a CUDA GPU when there is one (:data:`ON_GPU`,
:data:`DEVICE`), else on the CPU with Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton loads). :func:`assert_kernel_close` / :func:`scaled_atol` compare a kernel with the torch
reference; :func:`against_guard_page` places a tensor before an unreadable page;
:func:`flashinfer_refusal_here` is what FlashInfer's probe says on this machine; :class:`CountingAllocator`
lists what a call allocates. Imports torch.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"

# Kernel vs torch reference, as a fraction of the largest |reference| value. The exact kernel's dot
# operands are bfloat16, so the probabilities (and an fp32 q) are rounded to 8 bits before
# accumulation: measured 0.4-0.7 % on an H200. The interpreter rounds them the same way (it used to
# multiply fp32 operands, which tested numerics no GPU runs), so the bound is the same on both; the
# sharper numerics tests are the accuracy ones (tests/kernels/test_accuracy.py: cos_diff and relRMS
# against float64).
KERNEL_REL_TOL = 1e-2
# A bfloat16 output may also sit one bf16 ulp (2**-7 relative) away: rounding on GPUs and in the
# interpreter alike.
BF16_ULP = 2.0**-7


def scaled_atol(ref: torch.Tensor, rel: float) -> float:
    """``rel`` times the largest finite |ref| (at least 1, so values near 0 get an absolute floor)."""
    finite = ref[torch.isfinite(ref)].abs()
    return rel * max(1.0, finite.max().item() if finite.numel() else 0.0)


def assert_kernel_close(got: torch.Tensor, ref: torch.Tensor, rel: float = KERNEL_REL_TOL) -> None:
    """``got`` matches ``ref`` within ``rel`` of ref's magnitude (+1 bf16 ulp for bf16 values)."""
    got, ref = got.detach().cpu(), ref.detach().cpu()
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, got.dtype, ref.shape, ref.dtype)
    assert torch.equal(torch.isinf(got), torch.isinf(ref)), "infinities (empty rows) must agree"
    rtol = BF16_ULP if got.dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(got.double(), ref.double(), atol=scaled_atol(ref.double(), rel), rtol=rtol)


def against_guard_page(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` (same values, shape and strides) whose storage ends where an unreadable
    page begins, so a read one byte past its storage faults instead of returning garbage."""
    import ctypes
    import mmap

    nbytes = t.untyped_storage().nbytes()
    page = mmap.PAGESIZE
    data_pages = -(-max(nbytes, 1) // page)
    buf = mmap.mmap(-1, (data_pages + 1) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mprotect(ctypes.c_void_p(base + data_pages * page), ctypes.c_size_t(page), 0) != 0:  # PROT_NONE
        raise OSError(ctypes.get_errno(), "mprotect failed")
    start = data_pages * page - nbytes
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start)
    raw.copy_(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()))  # every byte of the storage
    typed = raw.view(t.dtype)
    guarded = typed.as_strided(t.shape, t.stride(), t.storage_offset())
    guarded._guard_buffer = buf  # keep the mapping alive as long as the tensor
    return guarded


def flashinfer_refusal_here() -> str | None:
    """A phrase FlashInfer's probe puts in its reasons on this machine (flashinfer installed), or None
    on an SM12x GPU, where it may run: tests assert according to what is there, not what CI has."""
    if not ON_GPU:
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    return None if major == 12 else f"is sm_{major}{minor}"


# --- Graph safety: what a call allocates --------------------------------------------------------


class CountingAllocator(TorchDispatchMode):
    """Every torch op run inside it whose result lives in storage none of its inputs had: an
    allocation (a view, an in-place op or an ``out=`` op adds none). ``allocations`` lists them
    as (op, shape, dtype); a call replayed from a CUDA graph must make none of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[tuple[str, tuple, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        seen = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and \
                    t.untyped_storage().data_ptr() not in seen:
                self.allocations.append((str(func), tuple(t.shape), t.dtype))
        return result
