"""Real vLLM 0.33 config objects for tiny DSA models, built on the CPU (no weights, no GPU)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import pytest

pytest.importorskip("vllm.config", reason="install the vllm extra: pip install -e '.[vllm]'")

import torch  # noqa: E402
from model_configs import write_model  # noqa: E402,F401  (re-exported for the vLLM tests)
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.platforms.interface import DeviceCapability  # noqa: E402

def make_vllm_config(model_dir: str, *, cache_dtype: str = "fp8_ds_mla", tp: int = 1,
                     additional_config: dict | None = None, enforce_eager: bool = False,
                     max_num_seqs: int = 256) -> VllmConfig:
    model_config = ModelConfig(model=model_dir, tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                               max_model_len=4096, enforce_eager=enforce_eager)
    return VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(cache_dtype=cache_dtype, block_size=64),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                                         max_model_len=4096, is_encoder_decoder=False),
        additional_config=additional_config or {},
    )


def selector_kwargs(kv_cache_dtype: str, cap: tuple[int, int]) -> dict:
    """The keyword arguments vLLM's CUDA selector passes to validate_configuration."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    cfg = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype,
                                  block_size=None, use_mla=True, use_sparse=True)
    return {"device_capability": DeviceCapability(*cap), **cfg._asdict()}


@pytest.fixture(autouse=True)
def _fresh_backend_state():
    from mla_sm120_plugin.context import clear_config_cache
    from mla_sm120_plugin.integration.vllm import backend

    backend.SLOT.clear()
    clear_config_cache()
    yield
    backend.SLOT.clear()
    clear_config_cache()


def make_impl(vllm_config: VllmConfig, *, heads: int, topk: int, kv_cache_dtype: str, scale: float):
    """The plugin's impl as vLLM's DSA attention layer constructs it (GLM-5 geometry), after the
    selector has validated the configuration, inside ``vllm_config``."""
    from vllm.config import set_current_vllm_config

    from mla_sm120_plugin.integration.vllm.backend import MlaSm120Backend, MlaSm120Impl

    topk_buffer = torch.full((vllm_config.scheduler_config.max_num_batched_tokens, topk), -1, dtype=torch.int32)
    with set_current_vllm_config(vllm_config):
        assert MlaSm120Backend.validate_configuration(**selector_kwargs(kv_cache_dtype, (12, 0))) == []
        return MlaSm120Impl(
            num_heads=heads, head_size=576, scale=scale, num_kv_heads=1, alibi_slopes=None, sliding_window=None,
            kv_cache_dtype=kv_cache_dtype, logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None,
            q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, qk_head_dim=256,
            v_head_dim=256, kv_b_proj=None, indexer=None, topk_indices_buffer=topk_buffer,
        )
