"""The DSA binding: the CUSTOM sparse-MLA attention backend for vLLM 0.33 and 0.34 (backend, metadata builder, impl).

Imported only when vLLM resolves ``--attention-backend CUSTOM``; heavy imports are fine here.
The decision (which kernel serves each phase) is made in :meth:`MlaSm120Backend.validate_configuration`,
which vLLM's selector calls while the model is being built, before any weight loads; the impl
binds that decision once and only dispatches at forward time. The plan comes from
:func:`.translate.plan_from_vllm`; :func:`logical_to_global` is the index translation the impl
uses where vLLM's Triton one does not apply.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl
from vllm.v1.attention.backend import AttentionBackend, MultipleOf
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import (
    FlashInferMLASparseMetadata,
    FlashInferMLASparseMetadataBuilder,
)
from vllm.v1.attention.backends.mla.sparse_utils import (
    align_blocks_to_rows,
    flat_kv_row_view,
    triton_convert_req_index_to_global_index,
    triton_filter_and_convert_dcp_index,
)

from ...errors import KernelUnavailable, UnsupportedConfiguration, format_error
from ...dispatch import dcp
from ...dispatch.bound import bind_decision
from ...rules import SERVED_SM_FAMILIES
from ...engines import lookup
from ...kernels.dsa.layout import KV_LORA_RANK, LAYOUTS, PAGE_SIZE, TOKEN_BYTES
from ...kernels.dsa.pack import page_view
from ...types import DECODE, PREFILL, Decision, SelectionContext
from .names import LOGGER_NAME
from .translate import current_vllm_config, device_capability, plan_from_vllm, release, validated_against

logger = logging.getLogger(LOGGER_NAME)

BACKEND_NAME = "MLA_SM120_SPARSE"  # not an in-tree name: those switch on name-keyed special cases
DCP_FILTER_ROWS = 128  # triton_filter_and_convert_dcp_index's tile: top-k rows a multiple of it wide


def decide(vllm_config: Any, kv_cache_dtype: str | None, major: int, minor: int) -> Decision:
    """The plan's one decision for vLLM's config on a device of capability ``major.minor`` (a DSA
    model's plan has one layer kind; the plan is made once a process, :func:`.translate.plan_from_vllm`).

    :raises UnsupportedConfiguration: with the combination, what is supported and the fix.
    :raises ConfigError: the plugin config (inline or file) is malformed.
    """
    return plan_from_vllm(vllm_config, kv_cache_dtype, (major, minor)).decision


def logical_to_global(
    logical: Any, req_id_per_token: Any, block_table: Any, *, block_size: int, block_stride_rows: int
) -> Any:
    """Per-request logical token positions -> rows of the flat KV view; -1 stays -1.

    :param logical: [N, topk], int32: positions within each token's request, -1 padded.
    :param req_id_per_token: [>=N], int32: the request row of each token.
    :param block_table: [num_reqs, max_blocks], int32: physical block ids.
    :returns: [N, topk], int32 global slots; -1 where the position is -1 or past the block table.
    """
    n = logical.shape[0]
    req = req_id_per_token[:n].long().unsqueeze(1)  # [N, 1]
    pos = logical.long()
    blk = torch.div(pos.clamp(min=0), block_size, rounding_mode="floor")  # [N, topk]
    valid = (pos >= 0) & (blk < block_table.shape[1])
    phys = block_table[req, blk.clamp(max=block_table.shape[1] - 1)].long()  # [N, topk]
    slots = phys * block_stride_rows + pos.remainder(block_size)
    return torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)


class MlaSm120MetadataBuilder(FlashInferMLASparseMetadataBuilder):
    """vLLM's sparse-MLA metadata, with only true decodes (1 + speculative tokens) counted as decode.

    The in-tree builder counts requests of up to 256-1024 new tokens as decodes (FlashInfer routes
    them internally); our decode kernels are split-K kernels for few rows, so short prefills go to
    the prefill kernel instead.
    """

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True, supports_dcp_with_varlen=True)


class MlaSm120Backend(AttentionBackend):
    """Sparse MLA for DSA models on SM120/SM121, kernels chosen per phase by mla_sm120_plugin."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    # fp8/fp8_e4m3 are absent on purpose: without vLLM's name-keyed rewrite they mean the plain
    # fp8 layout, which no kernel here reads (validate_configuration names the right flag).
    # nvfp4_ds_mla: vLLM's DSA writer fills its 352-byte rows (MLAAttention sizes the spec by the
    # name); the policy refuses it for a rope-less model, which has no nvfp4 writer.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["fp8_ds_mla", "nvfp4_ds_mla", "auto", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[MlaSm120Impl]:
        return MlaSm120Impl

    @staticmethod
    def get_builder_cls() -> type[MlaSm120MetadataBuilder]:
        return MlaSm120MetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[MultipleOf]:
        return [MultipleOf(PAGE_SIZE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # 576: GLM-5 / DeepSeek-V3.2 (latent + rope); 512: the rope-less GLM-5.3-Flash.
        return sorted({lay.head_dim for lay in LAYOUTS.values()})

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        # Pages sit a whole number of 64-token rows apart, so slots index a flat row view.
        return align_blocks_to_rows(spec, PAGE_SIZE)

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return capability.major in SERVED_SM_FAMILIES

    @classmethod
    def supports_sink(cls) -> bool:
        """Every kernel the plan binds applies a learned sink per head (a model with sinks is served
        by no other: selection's envelope), so HY V4's resolver keeps this backend and hands the
        impl its sink weights (``sinks=``) instead of disabling them."""
        return True

    @classmethod
    def validate_configuration(cls, **kwargs: Any) -> list[str]:
        """vLLM's selector hook: run our constraint matrix first, then vLLM's generic checks.

        Our refusals raise :class:`UnsupportedConfiguration` (vLLM lets it through unchanged), so the
        user sees the combination, what is supported and the fix, before any weight loads.
        """
        vllm_config = current_vllm_config()
        cap = kwargs["device_capability"]
        if vllm_config is None or vllm_config.model_config is None:
            return ["mla_sm120: no vLLM model config in scope; the backend decides per model"]
        validated_against((cap.major, cap.minor))
        decide(vllm_config, kwargs.get("kv_cache_dtype"), cap.major, cap.minor)
        return super().validate_configuration(**kwargs)


class MlaSm120Impl(SparseMLACommonImpl[FlashInferMLASparseMetadata]):
    """Binds the decided kernel per phase; ``forward_mqa`` only converts indices and dispatches."""

    supports_dense_mha_prefill = False  # every token goes through forward_mqa
    supports_pcp = False
    # Decode context parallelism: every kernel the plan binds returns its LSE (KernelSpec.returns_lse;
    # the plan refuses one that does not), asked in the base vLLM's merge is told here (the engine fact).
    supports_dcp = True
    can_return_lse_for_decode = True
    lse_base_on_e = lookup("vllm").dcp.lse_base_on_e
    # Speculative rows under DCP with an interleave > 1: each row's candidates are explicit ids from
    # the indexer, filtered per row by owner; no kernel derives a causal bound from rank-local lengths.
    supports_mtp_with_cp_non_trivial_interleave_size = True

    def __init__(self, *args: Any, sinks: torch.Tensor | None = None, **kwargs: Any) -> None:
        # vLLM's sparse-MLA base takes no sinks; HY V4 passes its [heads] fp32 sink parameter here
        # and loads the weights into it later, so the parameter itself is kept, never a copy.
        super().__init__(*args, **kwargs)
        self._mla_sm120_sinks = _checked_sinks(sinks, self.num_heads)
        vllm_config = current_vllm_config()
        if vllm_config is None:
            raise UnsupportedConfiguration(
                format_error("MlaSm120Impl built outside vLLM's model construction", "construction by vLLM",
                             "select it with --attention-backend CUSTOM")
            )
        # The plan vLLM's selector made (the same inputs: once a process), or, for an impl built
        # without the selector (a forced backend path), made now for the platform's device.
        self.decision = decide(vllm_config, self.kv_cache_dtype, *device_capability())
        self.kv_layout = self.decision.context.kv_cache_dtype
        # Proved here, while vLLM builds the model: before any weight loads and before graph
        # capture, on its own small buffers; bound and logged once a process, so later layers reuse it.
        kernels = bind_decision(self.decision, logger=logger).kernels
        self._mla_sm120_kernels = kernels
        self._mla_sm120_single_kernel = kernels[DECODE].name == kernels[PREFILL].name

    def get_fp8_ds_mla_row_bytes(self) -> int:
        """Bytes of one cache row in the layout this layer's ``--kv-cache-dtype`` gives it under the
        installed vLLM: 656 (fp8_ds_mla), 528 (fp8_ds_mla for a rope-less model on 0.34; 0.33 keeps
        656), 352 (nvfp4_ds_mla); a bf16 row's 1152 or 1024 (vLLM asks for fp8_ds_mla only). vLLM
        0.34 sizes the fp8_ds_mla cache spec and the index group's rows by it; vLLM's base answers
        656 for every model. Called while the base constructor runs, before the plan is bound, so it
        reads the layer's own geometry."""
        return TOKEN_BYTES[lookup("vllm", release()).kv_layout(self.kv_cache_dtype, None, self.qk_rope_head_dim)]

    def _run(self, phase: str, q: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
             **contract: Any) -> torch.Tensor | None:
        """Run ``phase``'s kernel into ``out`` with the contract's keyword arguments (the layer's sinks
        without DCP; a rank's share's under DCP: :func:`~mla_sm120_plugin.dispatch.dcp.rank_share`);
        the LSE [T, H] when asked for, else None."""
        kernel = self._mla_sm120_kernels[phase]
        if not kernel.graph_safe and q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise KernelUnavailable(
                format_error(
                    f"{kernel.name} ({phase}) reached during CUDA graph capture",
                    "graph-safe kernels inside captured decode",
                    "run with --enforce-eager, or install a graph-safe kernel (mla-sm120 doctor)",
                )
            )
        result = kernel.call(q, pages, slots, sm_scale=self.scale, kv_layout=self.kv_layout, out=out,
                             scale_format=self.decision.scale_format, **contract)
        return result[1] if contract.get("return_lse") else None

    def forward_mqa(self, q: Any, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: Any,
                    layer: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sparse MQA over the DSA cache for every row of the batch.

        q: ([N, H, 512], [N, H, 64]) bfloat16 (ql_nope may be a strided view) or packed [N, H, 576];
            for a rope-less model (GLM-5.3-Flash) ([N, H, 512], [N, H, 0])
        kv_c_and_k_pe_cache: [num_blocks, block_size, 656] uint8 (fp8_ds_mla, with or without the
            rope part), [num_blocks, block_size, 352] uint8 (nvfp4_ds_mla) or
            [num_blocks, block_size, 576 or 512] bfloat16; block stride may exceed
            block_size rows
        returns: (out [N, H, 512] in q's dtype, None); under decode context parallelism (out, lse
            [N, H] float32) over the ids this rank owns (:meth:`_forward_dcp`)

        The kernels get the cache as 64-row pages of vLLM's flat row view (slots are rows of it),
        the geometry FlashInfer's SM120 kernels are built for; blocks are whole 64-row pages apart
        (``customize_spec``), so the view always exists.
        """
        if isinstance(q, tuple):
            # [N, H, 576] contiguous; a rope-less model's q_pe is empty and ql_nope is the whole q.
            q = q[0] if q[1].shape[-1] == 0 else torch.cat(q, dim=-1)
        if self.dcp_world_size > 1:
            return self._forward_dcp(q, kv_c_and_k_pe_cache, attn_metadata)
        n = q.shape[0]
        logical = self.topk_indices_buffer[:n]  # [N, topk] positions within each request, -1 padded
        kv_rows, stride_rows = flat_kv_row_view(kv_c_and_k_pe_cache, attn_metadata.block_size)  # [rows, C]
        if q.is_cuda and logical.shape[1] % 128 == 0:
            slots = triton_convert_req_index_to_global_index(
                attn_metadata.req_id_per_token[:n], attn_metadata.block_table, logical,
                BLOCK_SIZE=attn_metadata.block_size, BLOCK_STRIDE_ROWS=stride_rows,
                NUM_TOPK_TOKENS=logical.shape[1],
            )
        else:
            slots = logical_to_global(
                logical, attn_metadata.req_id_per_token, attn_metadata.block_table,
                block_size=attn_metadata.block_size, block_stride_rows=stride_rows,
            )
        out = q.new_empty((n, q.shape[1], KV_LORA_RANK))  # [N, H, 512]
        sinks = {} if self._mla_sm120_sinks is None else {"sink": self._mla_sm120_sinks}
        self._run_phases(q, page_view(kv_rows), slots, out, attn_metadata.num_decode_tokens, **sinks)
        return out, None

    def _run_phases(self, q: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, nd: int,
                    topk_length: torch.Tensor | None = None, **contract: Any) -> torch.Tensor | None:
        """Each phase's kernel on its rows (``nd`` decode rows first, as vLLM reorders the batch), with the
        contract's keyword arguments; the rows' LSE [N, H] where one is asked for, else None."""
        n = q.shape[0]
        if self._mla_sm120_single_kernel or nd == n or nd == 0:
            phase = DECODE if self._mla_sm120_single_kernel or nd == n else PREFILL
            return self._run(phase, q, pages, slots, out, topk_length=topk_length, **contract)
        head, tail = (None, None) if topk_length is None else (topk_length[:nd], topk_length[nd:])
        lse = (self._run(DECODE, q[:nd], pages, slots[:nd], out[:nd], topk_length=head, **contract),
               self._run(PREFILL, q[nd:], pages, slots[nd:], out[nd:], topk_length=tail, **contract))
        return None if lse[0] is None else torch.cat(lse)

    def _forward_dcp(self, q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the call under decode context parallelism: attention over the top-k
        ids this rank owns, and the LSE vLLM's merge weighs it by.

        q: [N, H, D] bfloat16, H the DCP group's heads (gathered by vLLM's MLADCPManager)
        kv_cache: this rank's shard of the cache (the tokens it owns), as in :meth:`forward_mqa`
        returns: (out [N, H, 512] in q's dtype, lse [N, H] float32 in the base the impl declares; a row
            with no owned id: out 0, lse -inf, or the sink on the heads whose sinks this rank counts)
        """
        n = q.shape[0]
        logical = self.topk_indices_buffer[:n]  # [N, topk] positions within each request, -1 padded
        # vLLM's owner filter takes rows a multiple of 128 wide: pad with -1 (no candidate).
        width = -(-logical.shape[1] // DCP_FILTER_ROWS) * DCP_FILTER_ROWS
        if width != logical.shape[1]:
            logical = torch.nn.functional.pad(logical, (0, width - logical.shape[1]), value=-1)
        kv_rows, stride_rows = flat_kv_row_view(kv_cache, attn_metadata.block_size)
        # This rank's owned ids (owner = position // interleave % dcp), as slots of its own cache,
        # compacted to a prefix of each row; counts bound the prefix.
        slots, counts = triton_filter_and_convert_dcp_index(
            attn_metadata.req_id_per_token[:n], attn_metadata.block_table, logical.contiguous(),
            dcp_size=self.dcp_world_size, dcp_rank=self.dcp_rank,
            cp_kv_cache_interleave_size=attn_metadata.cp_kv_cache_interleave_size,
            BLOCK_SIZE=attn_metadata.block_size, BLOCK_STRIDE_ROWS=stride_rows, NUM_TOPK_TOKENS=width,
            return_valid_counts=True,
        )
        out = q.new_empty((n, q.shape[1], KV_LORA_RANK))  # [N, H, 512]: the gathered heads
        pages, nd = page_view(kv_rows), attn_metadata.num_decode_tokens
        rank = dcp.DcpRank.of(lookup("vllm", release()), self.dcp_world_size, self.dcp_rank)
        return out, dcp.rank_share(lambda q_, slots_, **contract: self._run_phases(q_, pages, slots_, out, nd,
                                                                                   **contract),
                                   q, slots, counts, rank=rank, sinks=self._mla_sm120_sinks)


def _checked_sinks(sinks: Any, num_heads: int) -> torch.Tensor | None:
    """HY V4's sink parameter as the impl receives it: [num_heads] float32 (a head's logit, natural log)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_heads,):
        given = (f"a tensor of shape {tuple(sinks.shape)}, dtype {sinks.dtype}" if isinstance(sinks, torch.Tensor)
                 else type(sinks).__name__)
        raise UnsupportedConfiguration(format_error(
            f"sinks={given} for an attention layer of {num_heads} heads a rank",
            f"a [{num_heads}] float32 tensor: one learned sink logit a head",
            "build the layer with the model's own sink parameter (vLLM's make_attention_sink)"))
    return sinks

