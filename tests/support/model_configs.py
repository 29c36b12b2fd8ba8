"""Tiny HF configs (no weights) of the DSA models, saved as a user's model directory would hold them.

Shared by the engine suites (vLLM and SGLang each build their own config objects from the files).
"""

from __future__ import annotations

import json
import os

TINY = dict(
    vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=256, qk_rope_head_dim=64,
    index_n_heads=4, index_head_dim=128, max_position_embeddings=4096,
)


def write_model(root, kind: str, *, index_topk: int = 2048, heads: int | None = None, **changes) -> str:
    """Save a tiny HF config (no weights) of ``kind`` ("glm", "dsv32", "glm53", "hyv4", "llama") and return its
    directory.

    "glm53" is the rope-less GLM-5.3-Flash (transformers' Glm5NextTextConfig, vLLM's text-only
    architecture; index_kpool 4 as released, plus the two keys vLLM reads that the class does not
    declare); "glm53mm" the same as the released multimodal config (Glm5NextConfig), SGLang's.

    ``changes`` override config fields (``kv_lora_rank=256``); they name the directory too."""
    from transformers import DeepseekV32Config, GlmMoeDsaConfig, LlamaConfig

    if kind == "glm":
        cfg = GlmMoeDsaConfig(num_attention_heads=heads or 64, qk_nope_head_dim=192, v_head_dim=256,
                              num_key_value_heads=heads or 64, index_topk=index_topk, **TINY)
        cfg.architectures = ["GlmMoeDsaForCausalLM"]
    elif kind == "dsv32":
        cfg = DeepseekV32Config(num_attention_heads=heads or 128, qk_nope_head_dim=128, v_head_dim=128,
                                num_key_value_heads=heads or 128, index_topk=index_topk, **TINY)
        cfg.architectures = ["DeepseekV32ForCausalLM"]
    elif kind in ("glm53", "glm53mm"):
        from transformers import Glm5NextConfig, Glm5NextTextConfig

        text = dict(
            vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=512, q_lora_rank=256,
            qk_rope_head_dim=0, qk_nope_head_dim=256, v_head_dim=256, num_attention_heads=heads or 64,
            num_key_value_heads=heads or 64, index_topk=index_topk, index_head_dim=128, index_n_heads=4,
            index_kpool=4, max_position_embeddings=4096, mla_use_nope=True, indexer_rope_interleave=False)
        if kind == "glm53":  # vLLM's text-only architecture
            cfg = Glm5NextTextConfig(**text)
            cfg.architectures = ["Glm5NextForCausalLM"]
        else:  # the released multimodal checkpoint's: the only one SGLang 0.5.23 knows
            cfg = Glm5NextConfig(text_config=text)
            cfg.architectures = ["Glm5NextForConditionalGeneration"]
    elif kind == "hyv4":
        # HY V4 (Hy4-preview) as its release writes config.json; transformers' own HYV4Config has no
        # learnable_sink key (its model always has sinks), the engines' configs read it.
        path = os.path.join(str(root), f"{kind}_topk{index_topk}_h{heads}")
        os.makedirs(path, exist_ok=True)
        cfg = dict(architectures=["HYV4ForCausalLM"], model_type="hy_v4", num_attention_heads=heads or 32,
                   num_key_value_heads=heads or 32, qk_nope_head_dim=192, v_head_dim=256, index_topk=index_topk,
                   learnable_sink=True, gated_mla=True, gating_type="elementwise", num_nextn_predict_layers=1,
                   dtype="bfloat16", **{**TINY, "num_hidden_layers": 2}, **changes)
        with open(os.path.join(path, "config.json"), "w") as fh:
            json.dump(cfg, fh)
        return path
    else:
        cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
        cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "bfloat16"
    for key, value in changes.items():
        setattr(cfg, key, value)
    suffix = "".join(f"_{key}{value}" for key, value in sorted(changes.items()))
    path = os.path.join(str(root), f"{kind}_topk{index_topk}_h{heads}{suffix}")
    cfg.save_pretrained(path)
    return path
