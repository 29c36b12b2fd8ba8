"""The test command: ``nox`` runs every engine release's suite, each in its own environment.

vLLM 0.33, vLLM 0.34 and SGLang 0.5.23 pin different FlashInfer (and SGLang different torch) builds,
so each gets a session with its own environment, built once (by uv, from the project's own extras)
and reused by later runs:

    nox                  # every suite: vllm (0.33, and every engine-free suite), vllm034, sglang
    nox -s vllm          # one suite alone; arguments after -- go to pytest:
    nox -s sglang -- tests/sglang_engine/test_forward.py -x

Each session runs pytest on all cores (pytest-xdist), derandomized Hypothesis (the same examples on
every run). ``MLA_NOX_DROP_ENVS=1`` deletes each session's environment after its tests (10-11 GB
each; CI sets it, so only one is on disk at a time).
"""

from __future__ import annotations

import os
import shutil
import time

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["vllm", "vllm034", "sglang"]

# --dist loadfile: a file's tests run on one worker, so a file's memoized fixtures (the compile
# gate's three compiles) are made once. (--dist loadgroup does not group under pytest 9.2, whose
# nodes no longer read the _nodeid that pytest-xdist 3.8 rewrites.)
PYTEST = ["-q", "--hypothesis-profile=ci", "-n", "auto", "--dist", "loadfile", "--durations=15"]
# The engine-free suites (unit, kernels, tools, dispatch) run once, in the vllm session; the other sessions
# run their engine's suite only, vllm034 with the tests that read the installed FlashInfer (0.7.4 there:
# its API contract, its envelope table, the binding's arguments).
FLASHINFER_VERSIONED = ["tests/dispatch/test_flashinfer_contract.py", "tests/dispatch/test_flashinfer_table.py",
                        "tests/dispatch/test_flashinfer_binding.py"]
SESSIONS = {
    "vllm": dict(extras="vllm,triton,flashinfer,test,plot", paths=[]),
    "vllm034": dict(extras="vllm034,triton,flashinfer,test", paths=["tests/vllm", *FLASHINFER_VERSIONED],
                    overrides=".ci/vllm034-overrides.txt"),
    "sglang": dict(extras="sglang,test", paths=["tests/sglang_engine"]),
}


def _free_gib() -> str:
    return f"{shutil.disk_usage('.').free / 2**30:.1f} GiB free"


def _run_suite(session: nox.Session, extras: str, paths: list[str], overrides: str | None = None) -> None:
    start = time.monotonic()
    session.install("-e", f".[{extras}]", *(["--override", overrides] if overrides else []))
    session.log(f"{session.name}: environment ready in {time.monotonic() - start:.0f} s, {_free_gib()}")
    tests = time.monotonic()
    try:
        session.run("python", "-m", "pytest", *PYTEST, *(session.posargs or paths))
    finally:
        session.log(f"{session.name}: tests ran {time.monotonic() - tests:.0f} s")
        if os.environ.get("MLA_NOX_DROP_ENVS") == "1":
            shutil.rmtree(session.virtualenv.location, ignore_errors=True)
            session.log(f"{session.name}: environment removed (MLA_NOX_DROP_ENVS=1), {_free_gib()}")


@nox.session
def vllm(session: nox.Session) -> None:
    """vLLM 0.33 with FlashInfer and Triton: every suite (the SGLang one skips here)."""
    _run_suite(session, **SESSIONS["vllm"])


@nox.session
def vllm034(session: nox.Session) -> None:
    """vLLM 0.34.0: the vLLM engine and FlashInfer suites (the engine-free ones ran under vllm).

    vLLM 0.34.0 pins flashinfer-python==0.7.3, which CI's package index lacks: uv's --override
    (.ci/vllm034-overrides.txt) installs FlashInfer 0.7.4 in its place.
    """
    _run_suite(session, **SESSIONS["vllm034"])


@nox.session
def sglang(session: nox.Session) -> None:
    """SGLang 0.5.23: its engine suite and the engine-free unit suite."""
    _run_suite(session, **SESSIONS["sglang"])
