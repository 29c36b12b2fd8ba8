"""Shared fixtures: a fresh plugin registry, probe cache and self-check cache around every test.

Without a GPU, Triton kernels run in Triton's interpreter. ``TRITON_INTERPRET`` must be set
before triton is first imported (vLLM imports it too), so it is set here, before any test module.
Whether there is a GPU is torch's answer, the same one the kernel tests take their device from
(support.kernel_checks.ON_GPU): a stray or broken ``nvidia-smi`` on PATH changes neither. torch itself
is optional here: the torch-free unit tests (and the torch-free helpers, tests/support/) run without it.

Hypothesis: ``--hypothesis-profile=ci`` (what .ci/run passes) derandomizes every property test, so
CI sees the same examples on every run; without it, each local run explores new ones.
"""

from __future__ import annotations

import os

try:
    import torch
except ImportError:  # a torch-free install runs the torch-free tests only: no kernel, nothing to interpret
    torch = None

if torch is None or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(autouse=True)
def _fresh_registry():
    from mla_sm120_plugin.hooks.manager import reset_registry
    from mla_sm120_plugin.selection import clear_probe_cache

    def clear():
        reset_registry()
        clear_probe_cache()
        if "mla_sm120_plugin.dispatch.selfcheck" in sys.modules:  # it imports torch: only when used
            sys.modules["mla_sm120_plugin.dispatch.selfcheck"].clear_cache()
        if "mla_sm120_plugin.dispatch.bound" in sys.modules:  # what the engine bindings bound
            sys.modules["mla_sm120_plugin.dispatch.bound"].clear()

    clear()
    yield
    clear()


# The engine suites build the plugin's impl or backend the way the engine does, and the engine's
# construction runs the init self-check: each build checks the bound kernels again, in Triton's
# interpreter (~2/3 of these suites' time). A test there runs it only when it is about it, marked
# ``@pytest.mark.self_check``; the others run as a user with MLA_SM120_SELF_CHECK=off does (a documented
# setting: the binding is the same, only the check is skipped). The self-check itself is held by
# tests/dispatch (every kernel, layout, phase and LSE form) and by the marked engine tests (the engine's
# own construction context, its DCP facts, its fallback and refusal). Fresh-process tests start from
# support.cli.clean_env, which carries no MLA_SM120_* variable: their self-check runs.
ENGINE_SUITES = ("vllm", "sglang_engine")


def pytest_configure(config):
    config.addinivalue_line("markers", "self_check: an engine-suite test that runs the init self-check "
                                       "(the others run with MLA_SM120_SELF_CHECK=off)")


@pytest.fixture(autouse=True)
def _self_check_only_where_marked(request):
    # Its own MonkeyPatch, not the test's: asking for the ``monkeypatch`` fixture here would set it up
    # before every module's autouse fixtures, so it would undo a test's patches after their teardowns ran.
    from mla_sm120_plugin.envs import SELF_CHECK

    if request.path.parent.name not in ENGINE_SUITES or request.node.get_closest_marker("self_check") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SELF_CHECK, "off")
        yield


def _pip_install_target(tmp_path_factory, fixture: str) -> Path:
    """pip-install the fixture distribution ``tests/fixtures/<fixture>`` into its own target dir."""
    pytest.importorskip("setuptools", reason="building the fixture plugins needs setuptools (the test extra's venv has it)")
    target = tmp_path_factory.mktemp(fixture)
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources, which a
    # read-only checkout (an unprivileged user's run) refuses, and which would dirty the tree.
    source = tmp_path_factory.mktemp(f"{fixture}-src") / fixture
    shutil.copytree(FIXTURES / fixture, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
            "--target", str(target), str(source),
        ],
        check=True,
    )
    return target


@pytest.fixture(scope="session")
def demo_plugin_path(tmp_path_factory) -> Path:
    """The demo third-party plugin, pip-installed into its own target dir as a user would."""
    return _pip_install_target(tmp_path_factory, "demo_plugin")


@pytest.fixture(scope="session")
def noscale_plugin_path(tmp_path_factory) -> Path:
    """A third-party kernel that ignores the fp8 scales, pip-installed into its own target dir."""
    return _pip_install_target(tmp_path_factory, "noscale_plugin")


@pytest.fixture
def make_case():
    """:func:`support.kernel_cases.build_case`: a random cache in any layout with its candidates and q."""
    from support.kernel_cases import build_case

    return build_case


@pytest.fixture
def make_paged_cache():
    """:func:`support.kernel_cases.paged_cache`: a zeroed cache, optionally page-strided."""
    from support.kernel_cases import paged_cache

    return paged_cache
