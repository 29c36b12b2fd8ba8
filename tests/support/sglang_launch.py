"""SGLang's launcher, as the SGLang tests run it on the CPU: server arguments for a model directory
and the DSA backend pass it runs (imports SGLang: only for the SGLang environment's tests)."""

from __future__ import annotations

from sglang.srt.arg_groups import overrides
from sglang.srt.server_args import ServerArgs


def server_args(model_dir: str, **kw) -> ServerArgs:
    return ServerArgs(model_path=model_dir, skip_tokenizer_init=True, **kw)


def resolve(model_dir: str, **kw) -> tuple[str, str]:
    """Run the pass as SGLang's launcher does; the DSA backends the resolved arguments name."""
    sa = server_args(model_dir, **kw)
    overrides.run_post_process_pass(sa, overrides._dsa_split_backend_resolution)
    view = overrides.ResolvedView(sa, overlay=overrides._declaration_overlay(sa))
    return view.dsa_prefill_backend, view.dsa_decode_backend


def launch(model_dir: str, **kw) -> tuple[str, str, str]:
    """SGLang's launcher's model adjustments (``handle_model_specific_adjustments``: its per-model overrides, then
    the DSA passes, the plugin's among them); the DSA backends and KV dtype the resolved arguments name."""
    from sglang.srt.arg_groups import model_hook

    sa = server_args(model_dir, **kw)
    model_hook.handle_model_specific_adjustments(sa)
    view = overrides.ResolvedView(sa, overlay=overrides._declaration_overlay(sa))
    return view.dsa_prefill_backend, view.dsa_decode_backend, view.kv_cache_dtype
