"""One DCP rank of SGLang 0.5.23 on the CPU: the plugin's kernels inside SGLang's own decode-context-parallel pieces.

:func:`run_ranks` starts ``world`` processes (spawn) that join one gloo group through SGLang's own
``init_distributed_environment`` and ``init_model_parallel_group``, published as the DCP group with
``get_parallel().override_permanently`` (SGLang's ``initialize_model_parallel`` builds its DCP group only
over CUDA devices). Each rank (:func:`_rank`) then runs every case as SGLang's DSA layer does under
``--dcp-size N`` (``models/deepseek_common/attention_forward_methods/forward_mla.py``):

- the launcher's own passes plan (``handle_model_specific_adjustments``: SGLang's model overrides, its
  KV-dtype default, the DSA backend pass the plugin hooks) at TP = DCP = ``world``;
- the rank's cache holds only the slots it owns: SGLang's DCP cache writer
  (``set_mla_kv_buffer_dcp_sharded_triton``) writes a bf16 cache; an fp8 cache is SGLang's
  ``quantize_k_cache`` of the whole cache (a row's bytes are its own) keeping the rows the writer keeps
  (``slot % world == rank`` at ``slot // world``, which the bf16 case checks against the writer);
- q's heads are gathered by ``all_gather_q_for_mla_decode``; the hooked ``forward_decode`` /
  ``forward_extend`` reach SGLang's ``_forward_flashinfer_sparse_mla`` (unbound, on a backend with the
  attributes SGLang's constructor sets: ``dcp_size`` / ``dcp_rank`` from ``get_parallel()``, a
  ``DcpPageTableCache``), and so the plugin's call, for two layers sharing one top-k (the second reuses
  the localized table, as SGLang's own DCP path does);
- the ranks' outputs are merged by ``cp_lse_ag_out_rs_mla`` (SGLang's default) or ``dcp_a2a_lse_reduce``
  in the LSE base ``is_mla_dcp_lse_base_on_e`` gives the ``dsa`` backend.

SGLang's registered collectives (``reg_reduce_scatter_tensor``, ``reg_all_to_all_single``) are custom ops
with CUDA kernels only; each rank points them at the group methods their bodies call. Each rank returns its
merged output for its own heads, its partial (out, LSE) and the float64 oracle for the same heads over the
whole cache and over the slots it owns (:func:`support.dcp.expected`, the fp8 rows read from SGLang's bytes
by :mod:`support.layout_oracle`), as numpy arrays (a tensor shared with the parent dies with the child).
What both engines' DCP tests share is :mod:`support.dcp`. Imported by the children, so nothing runs at import.
"""

from __future__ import annotations

import math
import os
import types
from dataclasses import dataclass

import torch

from support import dcp, layout_oracle

LOCAL_SLOTS, PAGE, HEAD_DIM, LATENT = 192, 64, 576, 512


@dataclass(frozen=True)
class Case(dcp.DcpCase):
    """One DCP forward (:class:`support.dcp.DcpCase`), SGLang's defaults, and its forward mode."""

    model: str = "glm"  # "glm" or "hyv4" (learned sinks, SGLang's forced bf16 cache)
    kv: str = "fp8_e4m3"  # SGLang's --kv-cache-dtype ("auto" for HY V4: bfloat16)
    comm: str = "ag_rs"  # SGLang's --dcp-comm-backend: "ag_rs" (cp_lse_ag_out_rs_mla) or "a2a"
    mode: str = "DECODE"  # SGLang's ForwardMode: DECODE, TARGET_VERIFY (1 + gamma rows a request), EXTEND

    @property
    def sinks(self) -> bool:
        return self.model == "hyv4"


def _problem(case: Case, world: int):
    """What every rank agrees on (one seed): the whole cache's rows, slot tables, q, sinks, top-k slots."""
    from sglang.kernels.ops.attention.dsa.transform_index import transform_index_page_table_decode

    gen = dcp.generator(case, world)
    slots_total = LOCAL_SLOTS * world
    keys = (torch.randn(slots_total, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
    # Each request's positions at distinct slots, never slot 0 (SGLang's padding slot, which its writer skips).
    order = (torch.randperm(slots_total - 1, generator=gen) + 1).to(torch.int32)
    tables, start = [], 0
    for sl in case.seq_lens:
        tables.append(order[start:start + sl])
        start += sl
    rows = []  # (request, positions visible) per query row: causal within a request's new tokens
    for r, (ql, sl) in enumerate(zip(case.q_lens, case.seq_lens)):
        rows += [(r, sl - ql + 1 + j) for j in range(ql)]
    n = len(rows)
    width = max(case.seq_lens)
    page_table = torch.zeros(n, width, dtype=torch.int32)
    topk = torch.full((n, case.topk), -1, dtype=torch.int32)
    for t, (r, visible) in enumerate(rows):
        page_table[t, : case.seq_lens[r]] = tables[r]
        picks = torch.randperm(visible, generator=gen)[: min(visible, int(torch.randint(1, case.topk + 1, (1,),
                                                                                          generator=gen)))]
        topk[t, : len(picks)] = picks.to(torch.int32)
    dcp.rewrite_special_rows(topk, case, lambda r, p: int(tables[r][p]) % world == 0)
    slots = transform_index_page_table_decode(page_table, topk, page_size=1)  # SGLang's: positions -> slots
    q = torch.randn(n, case.heads * world, HEAD_DIM, generator=gen).to(torch.bfloat16)
    sinks = (torch.randn(case.heads * world, generator=gen) * 2).float() if case.sinks else None
    return keys, slots, topk, q, sinks


def _local_cache(case: Case, keys, world: int, rank: int):
    """This rank's pool buffer ([LOCAL_SLOTS, 1, C]) and float64 keys of the whole cache as SGLang stores them
    (the fp8 rows read from SGLang's bytes by :mod:`support.layout_oracle`)."""
    from sglang.kernels.ops.kvcache.mla_buffer import set_mla_kv_buffer_dcp_sharded_triton
    from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache

    if case.kv == "fp8_e4m3":
        packed = quantize_k_cache(keys.view(-1, PAGE, 1, HEAD_DIM)).view(-1, 1, 656)  # SGLang's fp8 writer
        # The stored values exactly (fp8 x scale; SGLang's own dequantization rounds them to bf16).
        keys64 = layout_oracle.decode_cache(packed.view(torch.uint8)[:, 0], "fp8_ds_mla")
        return packed[rank::world].contiguous(), keys64, None
    local = torch.zeros(LOCAL_SLOTS, 1, HEAD_DIM, dtype=torch.bfloat16)
    loc = torch.arange(keys.shape[0], dtype=torch.int64)
    set_mla_kv_buffer_dcp_sharded_triton(local, loc, keys[:, None, :LATENT].contiguous(),
                                         keys[:, None, LATENT:].contiguous())
    # The writer's placement is the rule the fp8 case slices by (slot 0 is its padding slot, never written).
    kept = keys[rank::world].clone()
    if rank == 0:
        kept[0] = 0
    return local, keys.double(), bool(torch.equal(local[:, 0], kept))


def _setup_case(case: Case, world: int, model_dir: str):
    """The launcher: SGLang's passes with the plugin on; the plan reaches this process's environment."""
    from support.sglang_launch import launch

    from mla_sm120_plugin.context import clear_config_cache
    from mla_sm120_plugin.integration.sglang import dsa, names

    os.environ.pop(names.PLAN_ENV, None)
    os.environ[names.INLINE_CONFIG_ENV] = (f'{{"prefill_kernel": "{case.prefill_kernel}", '
                                           f'"decode_kernel": "{case.decode_kernel}"}}')
    clear_config_cache()
    dsa.reset_for_tests()
    return launch(model_dir, tp_size=world, dcp_size=world, kv_cache_dtype=case.kv, disable_cuda_graph=True,
                  dcp_comm_backend=case.comm if case.comm == "a2a" else None)


def _run_case(case: Case, world: int, rank: int, model_dir: str) -> dict:
    from sglang.srt.layers.attention.dsa.dsa_dcp import DcpPageTableCache
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.layers.dcp import all_gather_q_for_mla_decode, cp_lse_ag_out_rs_mla, dcp_a2a_lse_reduce
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla import is_mla_dcp_lse_base_on_e
    from sglang.srt.runtime_context import get_parallel

    from mla_sm120_plugin.integration.sglang import dsa

    routes = _setup_case(case, world, model_dir)
    keys, slots, topk, q, sinks = _problem(case, world)
    cache, keys64, placed = _local_cache(case, keys, world, rank)
    parallel = get_parallel()
    heads = case.heads
    mine = slice(rank * heads, (rank + 1) * heads)
    q_local = q[:, mine].contiguous()
    q_nope, q_pe = all_gather_q_for_mla_decode(q_nope_out=q_local[..., :LATENT], q_pe=q_local[..., LATENT:])
    q_all = torch.cat([q_nope, q_pe], dim=-1).contiguous()
    scale = 1 / math.sqrt(HEAD_DIM)
    backend = types.SimpleNamespace(  # what SGLang's DSA backend constructor sets and its call site reads
        workspace_buffer=torch.empty(0, dtype=torch.uint8), physical_page_size=PAGE, kv_cache_dim=cache.shape[-1],
        qk_nope_head_dim=192, kv_lora_rank=LATENT, qk_rope_head_dim=HEAD_DIM - LATENT,
        dcp_size=parallel.attn_dcp_size, dcp_rank=parallel.attn_dcp_rank,
        _dcp_page_table_cache=DcpPageTableCache(), forward_metadata=object())
    mode = getattr(ForwardMode, case.mode)
    entry = dsa.around_forward_decode if case.mode == "DECODE" else dsa.around_forward_extend
    base_e = is_mla_dcp_lse_base_on_e("dsa")

    def sglang_forward(*_args, **_kwargs):
        return DeepseekSparseAttnBackend._forward_flashinfer_sparse_mla(
            backend, q_all=q_all, kv_cache=cache, page_table_1=slots, seq_lens=None, sm_scale=scale,
            skip_softmax_threshold_scale_factor=None)

    merged, partials = [], []
    for layer_id in (0, 1):  # two layers sharing one top-k tensor: the second reuses the localized table
        extra = {"attn_sink": sinks[mine].clone()} if sinks is not None else {}
        out, lse = entry(sglang_forward, backend, q_all, None, None, types.SimpleNamespace(layer_id=layer_id),
                         types.SimpleNamespace(forward_mode=mode), topk_indices=topk, **extra)
        partials.append((out.float().clone(), lse.clone()))
        if case.comm == "a2a":
            result = dcp_a2a_lse_reduce(out.contiguous(), lse.contiguous(), parallel.dcp_group,
                                        is_lse_base_on_e=base_e, comm_backend="a2a")
        else:
            result = cp_lse_ag_out_rs_mla(out, lse, parallel.dcp_group, is_lse_base_on_e=base_e).transpose(0, 1)
        merged.append(result.reshape(-1, heads, LATENT).float())
    want, _ = dcp.expected(keys64, slots, q[:, mine], None if sinks is None else sinks[mine], scale)
    # this rank's partial: the slots it owns, its own heads' sinks only
    part_out, part_lse = dcp.expected(keys64, slots, q, dcp.own_sinks(sinks, world, rank), scale,
                                      keep=slots % world == rank)
    lse_nat = partials[0][1].double() * (1.0 if base_e else math.log(2.0))
    to_np = lambda t: t.double().numpy()  # noqa: E731
    return {"merged": [to_np(m) for m in merged], "want": to_np(want), "out": to_np(partials[0][0]),
            "lse": to_np(lse_nat), "part_out": to_np(part_out), "part_lse": to_np(part_lse),
            "layers_agree": bool(torch.equal(partials[0][0], partials[1][0])),
            "gathered_q": bool(torch.equal(q_all, q)), "routes": routes, "placed": placed,
            "base_e": base_e, "heads_planned": dsa.bound_state().kinds[dsa.KIND].decision.context.num_heads}


def _rank(rank: int, world: int, port: int, model_dirs: dict, cases: list, queue) -> None:
    def join() -> None:
        torch.cuda.get_device_capability = lambda *a, **k: (12, 0)  # "this GPU": an SM120 (launch tests' stand-in)
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.plugins import load_plugins
        from sglang.srt.runtime_context import get_parallel

        load_plugins()  # as every SGLang process does; the opt-in is in the environment
        ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")

        def reduce_scatter(output, input, group_name):  # noqa: A002 - the op's own argument names
            ps._groups[group_name]()._reduce_scatter_tensor(output, input)

        def all_to_all(output, input, group_name):  # noqa: A002
            ps._groups[group_name]()._all_to_all_single(output, input)

        ps.reg_reduce_scatter_tensor, ps.reg_all_to_all_single = reduce_scatter, all_to_all
        group = ps.init_model_parallel_group([list(range(world))], rank, "gloo", use_pynccl=False,
                                             use_custom_allreduce=False, group_name="dcp")
        get_parallel().override_permanently(dcp_group=group, attn_dcp_size=world, attn_dcp_rank=rank,
                                            dcp_enabled=True)

    dcp.serve_rank(rank, queue, join, lambda case: _run_case(case, world, rank, model_dirs[case.model]), cases)


def run_ranks(world: int, model_dirs: dict, cases: list, timeout: float = 900) -> dict:
    """Run ``cases`` on ``world`` gloo ranks; rank -> case name -> result (or a traceback string).

    The children run Triton kernels (SGLang's and the plugin's) in its interpreter on CPU tensors
    (``TRITON_INTERPRET=1``), see no CUDA device and have the plugin enabled; set for them only.
    """
    from mla_sm120_plugin.integration.sglang import names

    env = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", names.ENABLE_ENV: "1"}
    return dcp.run_ranks(_rank, world, (model_dirs, cases), env, timeout)
