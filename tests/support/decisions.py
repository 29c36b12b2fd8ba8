"""What the unit tests of selection, report, rules, hooks and the DCP plan share (torch-free; tests/unit only).

``_refusal``: the lines of the refusal ``mla-sm120 check`` prints (rules and selection pin its
words). ``_edge_registry`` / ``_edge_ctx`` / ``_edge_reasons``: the built-ins plus one third-party
kernel, ``edge``, of the highest priority with a chosen envelope, a context to decide for, and the
reasons it was rejected (selection, report and hooks pin what is decided and printed for it).
"""

from __future__ import annotations

from support.cli import assert_three_parts

from mla_sm120_plugin import cli

GLM_ARCH = "GlmMoeDsaForCausalLM"


def _refusal(capsys, *argv: str) -> list[str]:
    assert cli.main(["check", *argv]) == cli.EXIT_UNSERVABLE
    err = capsys.readouterr().err
    assert_three_parts(err.split("UnsupportedConfiguration: ", 1)[1])
    return err.split("UnsupportedConfiguration: ", 1)[1].rstrip("\n").splitlines()


def _edge_registry(**spec_fields):
    """The built-ins plus one third-party kernel, ``edge``, of the highest priority, with the given
    envelope (types.KernelSpec: heads inclusive, topk_min, topk_multiple, max_tokens)."""
    from mla_sm120_plugin.hooks import hookimpl
    from mla_sm120_plugin.hooks.manager import build_registry
    from mla_sm120_plugin.types import KernelSpec

    fields = dict(name="edge", phases=frozenset({"prefill", "decode"}), kv_cache_dtypes=frozenset({"fp8_ds_mla", "bf16"}),
                  vendors=frozenset({"nvidia", "cpu"}), sm_families=frozenset({12}), entry="edge.kernel:run",
                  priority=10_000)
    fields.update(spec_fields)

    class Edge:
        @hookimpl
        def mla_sm120_kernels(self):
            yield KernelSpec(**fields)

    return build_registry(load_entry_points=False, extra_plugins={"edge": Edge()})


def _edge_ctx(*, heads=16, topk=2048, device=None, **kw):
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.types import SelectionContext

    return SelectionContext(GLM_ARCH, "fp8_ds_mla", heads, topk, device or parse_device("12.0", source="--sm"), **kw)


def _edge_reasons(decision, phase="decode") -> tuple[str, ...]:
    return next((r.reasons for r in decision.rejections if r.kernel == "edge" and r.phase == phase), ())
