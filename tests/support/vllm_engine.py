"""vLLM as it builds and runs the plugin on a GPU, reproduced on the CPU with vLLM's own objects.

What a CPU test must copy from a GPU start-up (docs/facts.md#vllm-start-up), in one place for every vLLM test:

- :func:`make_vllm_config`: real ``VllmConfig`` objects for a tiny model directory (no weights);
- :func:`construction_context` / :func:`make_impl`: the impl built the way ``load_model`` builds
  the model, inside ``set_default_torch_dtype(model dtype)`` and ``torch.device(load device)``
  (``"meta"`` stands in for ``"cuda"``: any tensor made without an explicit device shows up);
- :func:`common_metadata` / :func:`build_metadata`: vLLM's own metadata builder on a batch of
  decode and prefill requests whose blocks sit a stride of rows apart (other layers' pages between);
- :func:`vllm_log`: vLLM's own console handler, the only one a vLLM process has.

No pytest fixtures here, and nothing that changes the environment at import: a subprocess (the
logging and worker tests) imports this module as a vLLM process would run the plugin.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import types
from typing import Iterator

import torch
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.platforms.interface import DeviceCapability
from vllm.utils.torch_utils import set_default_torch_dtype

LAYER = "model.layers.0.self_attn.attn"
# GLM-5's per-head widths: the softmax scale vLLM passes is (qk_nope + qk_rope) ** -0.5.
GLM_SCALE = (192 + 64) ** -0.5
# What MLAAttention hands the impl, per model family: head_size (latent + rope) and the per-head
# widths (GLM-5: nope 192 + rope 64, v 256; GLM-5.3-Flash: nope 256, no rope, v 256).
GEOMETRY = {
    "glm": dict(head_size=576, qk_nope_head_dim=192, qk_rope_head_dim=64, qk_head_dim=256, v_head_dim=256),
    "glm53": dict(head_size=512, qk_nope_head_dim=256, qk_rope_head_dim=0, qk_head_dim=256, v_head_dim=256),
}


def make_vllm_config(model_dir: str, *, cache_dtype: str = "fp8_ds_mla", tp: int = 1,
                     additional_config: dict | None = None, enforce_eager: bool = False,
                     max_num_seqs: int = 256, max_num_batched_tokens: int = 4096, block_size: int = 64,
                     attention_backend: str | None = None, dcp: int = 1, interleave: int = 1,
                     dcp_comm_backend: str | None = None) -> VllmConfig:
    """A real VllmConfig for the tiny model in ``model_dir``, on vLLM's CPU device config
    (``attention_backend``: what ``--attention-backend`` lands as; None: vLLM's default; ``dcp``,
    ``interleave``, ``dcp_comm_backend``: ``--decode-context-parallel-size``,
    ``--cp-kv-cache-interleave-size``, ``--dcp-comm-backend``)."""
    model_config = ModelConfig(model=model_dir, tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                               max_model_len=4096, enforce_eager=enforce_eager)
    return VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(cache_dtype=cache_dtype, block_size=block_size),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                                       cp_kv_cache_interleave_size=interleave, dcp_comm_backend=dcp_comm_backend),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=4096, is_encoder_decoder=False),
        attention_config=AttentionConfig(backend=attention_backend) if attention_backend else AttentionConfig(),
        additional_config=additional_config or {},
    )


def selector_kwargs(kv_cache_dtype: str, cap: tuple[int, int], head_size: int = 576) -> dict:
    """The keyword arguments vLLM's CUDA selector passes to validate_configuration."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    cfg = AttentionSelectorConfig(head_size=head_size, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype,
                                  block_size=None, use_mla=True, use_sparse=True)
    return {"device_capability": DeviceCapability(*cap), **cfg._asdict()}


@contextlib.contextmanager
def construction_context(vllm_config: VllmConfig, load_device: str = "meta") -> Iterator[None]:
    """What ``BaseModelLoader.load_model`` wraps model construction in: the model's default dtype and
    the load device (``"meta"`` for ``"cuda"`` on the CPU), with the config in scope."""
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(vllm_config.model_config.dtype):
        with torch.device(load_device):
            yield


@contextlib.contextmanager
def one_rank(vllm_config: VllmConfig) -> Iterator[None]:
    """vLLM's distributed state for one rank over gloo (a layer's linear layers need a TP group),
    set up under ``vllm_config`` and torn down after."""
    from vllm.distributed import parallel_state as ps

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vllm_config):
        ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                        local_rank=0, backend="gloo")
        ps.initialize_model_parallel(1, 1, backend="gloo")
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


def sm120_pick(cls, selected_backend, attn_selector_config, num_heads=None):
    """What vLLM's CUDA platform's ``get_attn_backend_cls`` answers on SM 12.0 (its module needs libcuda to
    import, so its rule is restated here, narrowed to sparse MLA): a selected backend if it validates
    (``--attention-backend CUSTOM``: the plugin's, which decides while it validates), else its SM120
    sparse-MLA backend. A test sets it on the platform's class."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if selected_backend is not None:
        reasons = selected_backend.get_class().validate_configuration(
            device_capability=DeviceCapability(12, 0), **attn_selector_config._asdict())
        if reasons:
            raise ValueError(f"Selected backend {selected_backend} is not valid: {reasons}")
        return selected_backend.get_path()
    return AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM120.get_path()


def make_impl(vllm_config: VllmConfig, *, heads: int, topk: int, kv_cache_dtype: str, scale: float = GLM_SCALE,
              load_device: str = "meta", cap: tuple[int, int] = (12, 0), model: str = "glm", **impl_args):
    """The plugin's impl as vLLM's MLA attention layer constructs it (``model``'s geometry, see
    :data:`GEOMETRY`): the selector validates first, then the impl is built inside
    :func:`construction_context` (``impl_args``: what a model adds, e.g. HY V4's ``sinks``).

    ``load_device="meta"`` is where a GPU start-up would build it (on ``cuda``); a test that runs the
    impl's forward on the CPU builds it on ``"cpu"`` so its buffers are usable there.
    """
    from mla_sm120_plugin.integration.vllm.backend import MlaSm120Backend, MlaSm120Impl

    geometry = GEOMETRY[model]
    with set_current_vllm_config(vllm_config):
        reasons = MlaSm120Backend.validate_configuration(**selector_kwargs(kv_cache_dtype, cap, geometry["head_size"]))
    if reasons:
        raise AssertionError(f"vLLM's selector would refuse the backend: {reasons}")
    with construction_context(vllm_config, load_device):
        # The indexer's shared buffer is vLLM's, made on the real device outside construction.
        with torch.device("cpu"):
            topk_buffer = torch.full((vllm_config.scheduler_config.max_num_batched_tokens, topk), -1,
                                     dtype=torch.int32)
        return MlaSm120Impl(
            num_heads=heads, scale=scale, num_kv_heads=1, alibi_slopes=None, sliding_window=None,
            kv_cache_dtype=kv_cache_dtype, logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None,
            q_lora_rank=256, kv_lora_rank=512, kv_b_proj=None, indexer=None, topk_indices_buffer=topk_buffer,
            **geometry, **impl_args,
        )


def common_metadata(q_lens: list[int], seq_lens: list[int], block_table: list[list[int]], *, page: int,
                    stride_rows: int):
    """A CommonAttentionMetadata for requests of ``q_lens`` new tokens (decodes first, as vLLM
    reorders them), blocks ``stride_rows`` rows apart."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    bt = torch.tensor(block_table, dtype=torch.int32)
    slots = [int(bt[r, p // page]) * stride_rows + p % page
             for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)) for p in range(sl - ql, sl)]
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(q_lens), num_actual_tokens=sum(q_lens), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_table_tensor=bt, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        causal=True, seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
        is_prefilling=torch.tensor([q > 1 for q in q_lens]),
    )
    # token_to_req_indices() is a vLLM Triton kernel that vLLM only imports with a GPU driver;
    # its cache is the documented way to hand the mapping over.
    cam._token_to_req_indices_cache = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens)).int()
    return cam


# FlashInfer's per-device DeepSeek-V4 workspace, by vLLM release (0.34 made the helper public).
DSV4_WORKSPACE = {"0.33.0": "_get_flashinfer_dsv4_workspace", "0.34.0": "get_flashinfer_dsv4_workspace"}


def dsv4_workspace(device):
    """The workspace vLLM's DeepSeek-V4 layer hands FlashInfer's call on ``device`` (vLLM's own helper)."""
    from vllm.models.deepseek_v4.nvidia import flashinfer_sparse

    from mla_sm120_plugin.engines import installed_release

    return getattr(flashinfer_sparse, DSV4_WORKSPACE[installed_release("vllm")])(device)


def impl_row_bytes(kv_cache_dtype: str, head_size: int) -> int:
    """What the plugin's impl answers vLLM for a cache row (``get_fp8_ds_mla_row_bytes``; vLLM 0.34
    sizes fp8_ds_mla specs by it) for a layer of ``head_size`` (576, or 512 rope-less)."""
    from mla_sm120_plugin.integration.vllm.backend import MlaSm120Impl

    impl = types.SimpleNamespace(kv_cache_dtype=kv_cache_dtype, qk_rope_head_dim=head_size - 512)
    return MlaSm120Impl.get_fp8_ds_mla_row_bytes(impl)


def kv_cache_spec(vllm_config: VllmConfig, kv_cache_dtype: str, topk: int, *, head_size: int = 576):
    """The layer's KV cache spec as vLLM makes it: ``MLAAttention.get_kv_cache_spec`` (vLLM's own
    code: 0.33 sizes the ds_mla rows, 656 or 352 bytes, by ``kv_cache_dtype``; 0.34 asks the impl for
    fp8_ds_mla's, which the plugin's impl answers), then the plugin backend's ``customize_spec``, as
    vLLM's KV cache manager applies it."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from mla_sm120_plugin.integration.vllm.backend import MlaSm120Backend

    impl = types.SimpleNamespace(get_fp8_ds_mla_row_bytes=lambda: impl_row_bytes(kv_cache_dtype, head_size))
    layer = types.SimpleNamespace(kv_cache_dtype=kv_cache_dtype, head_size=head_size, sliding_window=None,
                                  topk_buffer_width=topk, indexer=object(), non_causal_multi_token_decode=False,
                                  impl=impl)
    with set_current_vllm_config(vllm_config):
        return MlaSm120Backend.customize_spec(MLAAttention.get_kv_cache_spec(layer, vllm_config))


def build_metadata(vllm_config: VllmConfig, kv_cache_dtype: str, topk: int, cam, *, page: int = 64,
                   head_size: int = 576, dcp_manager=None):
    """vLLM's own metadata builder (the plugin's subclass) on ``cam``, for one layer (``head_size``:
    576, or 512 for a rope-less model; ``dcp_manager``: the layer's MLADCPManager under DCP, which
    the builder asks for)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    from mla_sm120_plugin.integration.vllm.backend import MlaSm120Backend

    byte_rows = impl_row_bytes(kv_cache_dtype, head_size) if kv_cache_dtype in ("fp8_ds_mla", "nvfp4_ds_mla") else None
    vllm_config.compilation_config.static_forward_context[LAYER] = types.SimpleNamespace(prefill_backend=None,
                                                                                         dcp_manager=dcp_manager)
    spec = MlaSm120Backend.customize_spec(MLAAttentionSpec(
        block_size=page, num_kv_heads=1, head_size=head_size, dtype=torch.uint8 if byte_rows else torch.bfloat16,
        cache_dtype_str=kv_cache_dtype, kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
        state_content_bytes=byte_rows, topk_buffer_width=topk, is_index_group_leader=True,
    ))
    with set_current_vllm_config(vllm_config):
        builder = MlaSm120Backend.get_builder_cls()(spec, [LAYER], vllm_config, torch.device("cpu"))
        return builder.build(common_prefix_len=0, common_attn_metadata=cam)


@contextlib.contextmanager
def vllm_log(level: int = logging.INFO) -> Iterator[list[str]]:
    """The messages vLLM's own console handler receives while the block runs, at ``level``.

    vLLM configures one handler, on its ``vllm`` logger (propagation off): a record that reaches it
    is on the console of a real vLLM process; a record of any other logger is on no console.
    """
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    root = logging.getLogger("vllm")
    handler = Collect(level)
    saved = root.level
    root.addHandler(handler)
    root.setLevel(min(saved or logging.WARNING, level))
    try:
        yield messages
    finally:
        root.removeHandler(handler)
        root.setLevel(saved)


def logical_to_rows(logical, q_lens: list[int], block_table: list[list[int]], page: int, stride_rows: int):
    """What vLLM's conversion of the top-k buffer is meant to give, restated for the expected values: a
    request's logical position ``p`` at row ``block_table[r][p // page] * stride_rows + p % page`` of the
    backing (blocks ``stride_rows`` rows apart, as vLLM interleaves layers); -1 kept.

    returns: [T, topk] int64, ids into the backing's rows (the oracle's ``ids``)
    """
    req_of = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    out = torch.full(logical.shape, -1, dtype=torch.int64)
    for t in range(logical.shape[0]):
        for j, p in enumerate(logical[t].tolist()):
            if p >= 0:
                out[t, j] = block_table[int(req_of[t])][p // page] * stride_rows + p % page
    return out


def logical_topk(gen, q_lens: list[int], seq_lens: list[int], topk: int):
    """vLLM's top-k buffer before forward_mqa converts it: per query token, random causal positions
    in its request (one duplicated, which counts twice), at random places in the row, -1 padded.

    returns: [sum(q_lens), topk] int32
    """
    rows = []
    for ql, sl in zip(q_lens, seq_lens):
        for i in range(ql):
            visible = sl - ql + i + 1
            k = min(topk, visible)
            pos = torch.randperm(visible, generator=gen)[:k]
            if k > 3:
                pos[-1] = pos[0]  # a duplicate slot counts twice
            row = torch.full((topk,), -1, dtype=torch.int32)
            row[torch.randperm(topk, generator=gen)[:k]] = pos.int()
            rows.append(row)
    return torch.stack(rows)
