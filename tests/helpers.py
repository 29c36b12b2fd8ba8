"""Helpers shared by the test modules (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


TESTS_DIR = Path(__file__).resolve().parent
# What a subprocess test inherits from the caller: how to find programs, files and the GPU the
# caller sees; never the caller's plugin, engine or Triton settings (MLA_SM120_*, VLLM_*, SGLANG_*,
# TRITON_INTERPRET), which would make the test depend on the shell it was started from.
_BASE_ENV = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR", "CUDA_VISIBLE_DEVICES", "CUDA_HOME")


def clean_env(**extra: str) -> dict[str, str]:
    """A subprocess environment: :data:`_BASE_ENV` from this one, this checkout and the tests'
    helper modules on ``PYTHONPATH``, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k in _BASE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR.parent), str(TESTS_DIR)])
    env.update(extra)
    return env


def decision_of(report: dict, kind: str = "dsa") -> dict:
    """A layer kind's decision in a ``check --json`` report (one schema for every family: a DSA model
    is one kind, ``"dsa"``)."""
    return report["layer_kinds"][kind]["decision"]


def run_cli(*args: str, env: dict[str, str] | None = None, pythonpath: Path | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``mla-sm120`` in a subprocess, as a user would, from :func:`clean_env` (``timeout``: a
    guard against a hang, in seconds)."""
    full_env = clean_env()
    if pythonpath is not None:
        full_env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), full_env["PYTHONPATH"]])
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "mla_sm120_plugin.cli", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout,
    )


# The demo third-party distribution (tests/fixtures/demo_plugin): one good plugin, and broken ones
# that tests enable one at a time through MLA_SM120_DISABLE_PLUGINS.
DEMO_FAULTY_HOOKS = {
    "demo_select_raises": ["mla_sm120_select raised RuntimeError: demo select exploded"],
    "demo_select_exits": ["mla_sm120_select raised SystemExit: 3"],
    "demo_validate_int": ["mla_sm120_validate returned int 42"],
    "demo_validate_str": ["mla_sm120_validate returned str 'no'"],
}
DEMO_BROKEN = ("demo_broken_import", "demo_wrong_type", "demo_duplicate", "demo_exits_on_import",
               "demo_slow_import", *DEMO_FAULTY_HOOKS)


def demo_plugins_except(keep: str | None = None) -> dict[str, str]:
    """Environment that blocks every broken demo plugin but ``keep``."""
    return {"MLA_SM120_DISABLE_PLUGINS": ",".join(n for n in DEMO_BROKEN if n != keep)}


def assert_three_parts(message: str, given_prefix: str = "") -> None:
    """``message`` has the plugin's error shape: given / supported / fix, one per line."""
    lines = message.splitlines()
    assert lines[0].startswith(f"given: {given_prefix}"), message
    assert any(line.startswith("supported: ") for line in lines[1:]), message
    assert lines[-1].startswith("fix: ") or any(line.startswith("fix: ") for line in lines), message


# --- Kernel tests: one device, tolerances that scale with the values compared -------------------
# Kernel tests run where the kernels really run: on a CUDA GPU when there is one, else on the CPU
# with Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton loads).
import torch  # noqa: E402

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


CONFIG_SECTIONS = ("top", "arch", "glob", "exact")  # weakest first (README "Plugin config")


def config_with_sections(model: str, kinds: list[str], strong: str, weak: str) -> dict:
    """A plugin config whose ``decode_kernel`` is set in each section kind of ``kinds`` (of
    :data:`CONFIG_SECTIONS`): ``strong`` in the most specific of them, ``weak`` in every other one.
    The glob section matches ``model``'s parent directory; the architecture section is GLM-5's."""
    strongest = max(kinds, key=CONFIG_SECTIONS.index)
    value = {kind: strong if kind == strongest else weak for kind in kinds}
    data: dict = {}
    if "top" in value:
        data["decode_kernel"] = value["top"]
    if "arch" in value:
        data["architectures"] = {"GlmMoeDsaForCausalLM": {"decode_kernel": value["arch"]}}
    models = {}
    if "glob" in value:
        models[model.rsplit("/", 1)[0] + "/*"] = {"decode_kernel": value["glob"]}
    if "exact" in value:
        models[model] = {"decode_kernel": value["exact"]}
    if models:
        data["models"] = models
    return data


# --- Graph safety: what a call allocates --------------------------------------------------------
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


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
