"""What GPU this is: vendor, SM major/minor, CUDA version, or no GPU at all.

Detection avoids importing torch where it can (``nvidia-smi`` answers in milliseconds), and
can be overridden so a user can plan a deployment for another machine:
``MLA_SM120_DEVICE=sm_121`` (or ``12.1``, ``sm121``, ``cpu``, ``rocm``) or the CLI's ``--sm``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

from . import envs
from .errors import ConfigError, format_error
from .types import DeviceInfo

DEVICE_ENV = envs.DEVICE

# "sm_121"/"sm121a": the last digit is the minor (sm_90 -> 9.0); "12.1"/"12": major[.minor].
_SM_NAME_RE = re.compile(r"^sm_?(\d{1,2})(\d)a?$")
_SM_NUMBER_RE = re.compile(r"^(\d{1,2})(?:\.(\d))?$")
_ACCEPTED = "sm_120, sm_121, sm120, 12.0, 12.1, sm_90, 9.0, cpu or rocm"


def parse_device(text: str, *, source: str) -> DeviceInfo:
    """Turn ``"sm_121"``, ``"12.1"``, ``"sm90"``, ``"cpu"`` or ``"rocm"`` into a :class:`DeviceInfo`.

    :param text: the user's spelling.
    :param source: where it came from, for messages and for :attr:`DeviceInfo.is_planned`.
    :raises ConfigError: the text names no device.
    """
    value = text.strip().lower()
    if value == "cpu":
        return DeviceInfo("cpu", name="planned", source=source)
    if value in ("rocm", "amd", "hip"):
        return DeviceInfo("amd", name="planned", source=source)
    m = _SM_NAME_RE.match(value) or _SM_NUMBER_RE.match(value)
    if m is None:
        raise ConfigError(
            format_error(f"{source}={text!r}", _ACCEPTED, f"set {source} to one of those spellings")
        )
    major, minor = int(m.group(1)), int(m.group(2) or 0)
    if not 1 <= major <= 20:
        raise ConfigError(format_error(f"{source}={text!r} (SM major {major})", _ACCEPTED, f"fix {source}"))
    return DeviceInfo("nvidia", major, minor, name="planned", source=source)


def _from_nvidia_smi() -> DeviceInfo | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    fields = [p.strip() for p in out.splitlines()[0].split(",", 2)]
    if len(fields) != 3:  # an nvidia-smi that answers something else (an error text) found no GPU
        return None
    name, cap, _driver = fields
    major, _, minor = cap.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        return None
    return DeviceInfo("nvidia", int(major), int(minor), cuda_version=_cuda_toolkit_version(), name=name)


def _from_torch() -> DeviceInfo | None:
    try:
        import torch
    except ImportError:
        return None
    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return DeviceInfo("amd", name=torch.cuda.get_device_name(0))
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return DeviceInfo(
            "nvidia", major, minor, cuda_version=torch.version.cuda, name=torch.cuda.get_device_name(0)
        )
    return None


def find_nvcc() -> str | None:
    """nvcc where FlashInfer's JIT looks: $CUDA_HOME / $CUDA_PATH, then PATH, then /usr/local/cuda."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


@functools.cache
def nvcc_version(nvcc: str) -> str | None:
    """``"12.8"``-style release of an nvcc binary, or None when it does not answer."""
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", text)
    return match.group(1) if match else None


def _cuda_toolkit_version() -> str | None:
    nvcc = find_nvcc()
    return nvcc_version(nvcc) if nvcc else None


@functools.cache
def _detect_hardware(use_torch: bool) -> DeviceInfo:
    info = _from_nvidia_smi()
    if info is None and use_torch:
        info = _from_torch()
    if info is None and shutil.which("rocm-smi"):
        info = DeviceInfo("amd", name="ROCm GPU (rocm-smi)")
    return info or DeviceInfo("cpu", name="no GPU found")


def detect(*, override: str | None = None, use_torch: bool = False) -> DeviceInfo:
    """The device to decide for.

    :param override: a ``--sm`` value; beats the environment.
    :param use_torch: fall back to ``torch.cuda`` when ``nvidia-smi`` is absent (imports torch).
    :returns: the overridden device, else the detected one (cached per process).
    :raises ConfigError: an override names no device.
    """
    if override:
        return parse_device(override, source="--sm")
    env = os.environ.get(DEVICE_ENV)
    if env:
        return parse_device(env, source=DEVICE_ENV)
    return _detect_hardware(use_torch)


def from_capability(major: int, minor: int, *, name: str = "", cuda_version: str | None = None,
                    source: str = "vllm") -> DeviceInfo:
    """A device from an engine-reported compute capability (vLLM's ``DeviceCapability``, SGLang's
    ``torch.cuda.get_device_capability()``); ``source`` names the engine."""
    return DeviceInfo("nvidia", int(major), int(minor), cuda_version=cuda_version, name=name, source=source)


def device_for_tensor_type(device_type: str) -> DeviceInfo:
    """The device that tensors of ``torch.device(device_type)`` live on."""
    if device_type == "cpu":
        return DeviceInfo("cpu", name="cpu tensors")
    info = _from_torch()
    if info is None:
        raise ConfigError(
            format_error(f"tensors on {device_type!r}", "cuda or cpu tensors", "move the tensors to a CUDA GPU or the CPU")
        )
    return info
