"""One DCP rank of vLLM on the CPU: the plugin's impl inside vLLM's own decode-context-parallel pieces.

:func:`run_ranks` starts ``world`` processes (spawn) that join one gloo group through vLLM's own
``init_distributed_environment`` / ``initialize_model_parallel`` with TP = DCP = ``world``; each rank
(:func:`_rank`) then runs every case the way vLLM's DSA attention layer does under DCP
(``models/deepseek_v32/attention.py``):

- the impl is built by :func:`support.vllm_engine.make_impl` (selector first; ``dcp_world_size`` / ``dcp_rank``
  from vLLM's DCP group) and, for a model with sinks, gets its own heads' sink parameter, filled after
  construction as vLLM's loader fills it (then vLLM's ``process_weights_after_loading`` hook runs);
- the rank's cache holds only the tokens it owns (``position // interleave % world``, at
  ``position // (interleave * world) * interleave + position % interleave`` of its own block table);
- the layer's ``MLADCPManager`` (vLLM's) gathers q's heads over the group, the impl's ``forward_mqa``
  runs on the gathered q (vLLM's owner filter inside), and the manager's ``combine`` merges the ranks'
  outputs by their LSE in the base the impl declares, scattering the heads back.

Each rank returns its merged output for its own heads and its partial (out, LSE); the test compares them
with the float64 oracle over the whole cache and over the tokens the rank owns (:func:`expected`, the
rows read from the packed bytes by :mod:`support.layout_oracle`). What both engines' DCP tests share (the
case's fields, the special rows, the expected outputs, the rank launcher) is :mod:`support.dcp`.
Imported by the children, so nothing runs at import.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from support import dcp, layout_oracle

PAGE, STRIDE_ROWS, NUM_BLOCKS = 64, 128, 16


@dataclass(frozen=True)
class Case(dcp.DcpCase):
    """One DCP call (:class:`support.dcp.DcpCase`), vLLM's defaults, and the interleave and sinks."""

    model: str = "glm"  # vllm_engine.GEOMETRY key (hyv4 uses the glm geometry, with sinks)
    kv: str = "fp8_ds_mla"
    comm: str = "a2a"  # vLLM's --dcp-comm-backend: "a2a" or "ag_rs" (its default)
    topk: int = 512  # the smallest index_topk vLLM's DCP top-k merge takes; rows hold fewer ids
    q_lens: tuple[int, ...] = (1, 1, 3, 4)  # decodes first; a 3-row request: 1 + 2 draft tokens
    interleave: int = 1
    sinks: bool = False


def _owner_local(pos: int, world: int, interleave: int) -> tuple[int, int]:
    return (pos // interleave) % world, (pos // (interleave * world)) * interleave + pos % interleave


def _problem(case: Case, world: int):
    """Everything every rank agrees on (one seed): per-request packed token rows, q, sinks, top-k positions."""
    from support.vllm_engine import logical_topk

    from mla_sm120_plugin.kernels.dsa.pack import pack

    gen = dcp.generator(case, world)
    width = 512 if case.model == "glm53" else 576
    rows = []
    for sl in case.seq_lens:
        latent = torch.randn(sl, width, generator=gen)
        rows.append(pack(latent, _layout(case), "arbitrary"))
    n = sum(case.q_lens)
    logical = logical_topk(gen, list(case.q_lens), list(case.seq_lens), case.topk)
    dcp.rewrite_special_rows(logical, case, lambda r, p: _owner_local(p, world, case.interleave)[0] == 0)
    q = torch.randn(n, case.heads * world, width, generator=gen).to(torch.bfloat16)
    sinks = (torch.randn(case.heads * world, generator=gen) * 2).float() if case.sinks else None
    return rows, q, logical, sinks


def cache_rows64(case: Case, rows) -> torch.Tensor:
    """The whole cache's rows as their bytes hold them (:mod:`support.layout_oracle`), every request's
    rows back to back: [sum(seq_lens), width] float64, the keys :func:`expected` reads."""
    return torch.cat([layout_oracle.decode_cache(packed, _layout(case)) for packed in rows])


def _layout(case: Case) -> str:
    """The layout the installed vLLM writes for the case's ``--kv-cache-dtype`` and model."""
    from mla_sm120_plugin.context import kv_layout
    from mla_sm120_plugin.engines import installed_release

    return kv_layout(case.kv, "vllm", 12, 0 if case.model == "glm53" else 64, release=installed_release("vllm"))


def owned(pos, world: int, interleave: int, rank: int):
    """Which of the positions ``pos`` (a tensor) rank ``rank`` keeps."""
    return (pos // interleave) % world == rank


def expected(case: Case, keys64, q, logical, sinks, scale: float, rank: int | None = None,
             world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`support.dcp.expected` for vLLM's rows: each query row's logical positions in its own request's
    rows of ``keys64`` (:func:`cache_rows64`); ``rank``: only the positions that rank owns (its partial)."""
    req_of = torch.repeat_interleave(torch.arange(len(case.q_lens)), torch.tensor(case.q_lens))
    first_row = torch.tensor([sum(case.seq_lens[:r]) for r in range(len(case.seq_lens))])
    pos = logical.long()
    ids = torch.where(pos >= 0, pos + first_row[req_of][:, None], -1)
    keep = None if rank is None else owned(pos, world, case.interleave, rank)
    return dcp.expected(keys64, ids, q, sinks, scale, keep)


def _local_cache(case: Case, rows, world: int, rank: int):
    """This rank's cache (blocks ``STRIDE_ROWS`` rows apart, as vLLM interleaves layers) holding only the
    tokens it owns, and its block table (request -> its own blocks)."""
    from mla_sm120_plugin.kernels.dsa.pack import cache_dtype, token_width

    lay = _layout(case)
    backing = torch.zeros(NUM_BLOCKS * STRIDE_ROWS, token_width(lay), dtype=cache_dtype(lay))
    # Each request's local blocks, from the rank's end of the pool down (not 0, 1, 2: a wrong table shows).
    table = [[NUM_BLOCKS - 1 - 3 * r - b for b in range(3)] for r in range(len(case.seq_lens))]
    kept = 0
    for r, sl in enumerate(case.seq_lens):
        for p in range(sl):
            who, local = _owner_local(p, world, case.interleave)
            if who == rank:  # the rank keeps only what it owns
                backing[table[r][local // PAGE] * STRIDE_ROWS + local % PAGE] = rows[r][p]
                kept += 1
    return backing.view(NUM_BLOCKS, STRIDE_ROWS, -1)[:, :PAGE], table, kept


def _interpretable_ag_rs() -> None:
    """vLLM's AG+RS merge launches its correction kernel through a launcher that counts the kernel's
    ``constexprs``, an attribute of a compiled ``JITFunction`` that Triton's interpreter
    (``InterpretedFunction``) lacks; give the interpreted kernel the same list (vLLM's code is run as is)."""
    from vllm.v1.attention.ops import dcp

    kernel = dcp._CORRECT_ATTN_CP_OUT_KERNEL.kernel
    if not hasattr(kernel, "constexprs"):
        kernel.constexprs = [i for i, p in enumerate(inspect.signature(kernel.fn).parameters.values())
                             if "constexpr" in str(p.annotation)]


def _run_case(case: Case, world: int, rank: int, model_dir: str) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.ops.dcp import MLADCPManager
    from support.vllm_engine import GEOMETRY, build_metadata, common_metadata, make_impl, make_vllm_config

    from mla_sm120_plugin.integration.vllm import translate

    translate.reset_for_tests()
    geometry = GEOMETRY["glm53" if case.model == "glm53" else "glm"]
    scale = (geometry["qk_nope_head_dim"] + geometry["qk_rope_head_dim"]) ** -0.5
    vc = make_vllm_config(model_dir, cache_dtype=case.kv, tp=world, dcp=world, interleave=case.interleave,
                          dcp_comm_backend=case.comm, enforce_eager=True,
                          additional_config={"mla_sm120": {"decode_kernel": case.decode_kernel,
                                                            "prefill_kernel": case.prefill_kernel}})
    rows, q, logical, sinks = _problem(case, world)
    mine = slice(rank * case.heads, (rank + 1) * case.heads)
    sink_param = None
    if case.sinks:
        sink_param = torch.full((case.heads,), float("-inf"))  # as vLLM's make_attention_sink makes it
    impl = make_impl(vc, heads=case.heads, topk=case.topk, kv_cache_dtype=case.kv, scale=scale, load_device="cpu",
                     model="glm53" if case.model == "glm53" else "glm",
                     **({"sinks": sink_param} if sink_param is not None else {}))
    # The DCP checks the impl's construction ran (none with MLA_SM120_SELF_CHECK=off): kernel, phase, the
    # base of the LSE it held, the DCP size, sinks; and whether each passed with its LSE measured.
    from mla_sm120_plugin.dispatch import selfcheck

    self_checked = sorted((k.kernel, k.phase, k.lse, k.dcp, k.sinks, r.passed and r.lse is not None)
                          for k, r in selfcheck._results.items() if k.lse is not None)
    if sink_param is not None:
        sink_param.copy_(sinks[mine])  # the checkpoint's values, loaded after construction
        impl.process_weights_after_loading(torch.bfloat16)  # vLLM's hook, after the loader
    if case.comm == "ag_rs":
        _interpretable_ag_rs()
    with set_current_vllm_config(vc):
        manager = MLADCPManager(vc, torch.device("cpu"), num_heads=case.heads,
                                query_head_dim=q.shape[2], output_head_dim=512, query_dtype=torch.bfloat16,
                                output_dtype=torch.bfloat16, padded_num_heads=None,
                                is_lse_base_on_e=impl.lse_base_on_e, use_pcp=False)
    kv_cache, table, owned_rows = _local_cache(case, rows, world, rank)
    cam = common_metadata(list(case.q_lens), list(case.seq_lens), table, page=PAGE, stride_rows=STRIDE_ROWS)
    md = build_metadata(vc, case.kv, case.topk, cam, head_size=q.shape[2], dcp_manager=manager)
    n = q.shape[0]
    impl.topk_indices_buffer[:n] = logical
    gathered = manager.query_gather(q[:, mine].contiguous())
    out, lse = impl.forward_mqa(gathered, kv_cache, md, layer=None)
    partial, partial_lse = out.float(), lse.clone()  # vLLM's AG+RS merge rescales its input in place
    merged = manager.combine(out, lse, seq_lens=None, query_start_loc=None)
    return {"merged": merged.float(), "out": partial, "lse": partial_lse, "gathered_heads": gathered.shape[1],
            "decision": (impl.decision.prefill, impl.decision.decode), "decision_heads": impl.decision.context.num_heads,
            "num_decode_tokens": md.num_decode_tokens, "owned_rows": owned_rows, "scale": scale,
            "self_checked": self_checked}


def _rank(rank: int, world: int, port: int, model_dirs: dict, cases: list, queue) -> None:
    def join() -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state as ps

        import vllm.model_executor.layers.attention.sparse_mla_attention as sma
        from support.vllm_engine import make_vllm_config

        sma.PIN_MEMORY = False  # what vLLM's CPU-less platform lacks (as the cpu_vllm fixture sets it)
        base = make_vllm_config(next(iter(model_dirs.values())), tp=world, dcp=world)
        with set_current_vllm_config(base):
            ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                            distributed_init_method=f"tcp://127.0.0.1:{port}")
            ps.initialize_model_parallel(tensor_model_parallel_size=world, decode_context_model_parallel_size=world,
                                         backend="gloo")

    def leave() -> None:
        from vllm.distributed import parallel_state as ps

        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()

    dcp.serve_rank(rank, queue, join, lambda case: _run_case(case, world, rank, model_dirs[case.model]), cases, leave)


def run_ranks(world: int, model_dirs: dict, cases: list, timeout: float = 900, self_check: str = "on") -> dict:
    """Run ``cases`` on ``world`` gloo ranks; rank -> case name -> result (or a traceback string).

    The children run Triton kernels in its interpreter on CPU tensors (``TRITON_INTERPRET=1``) and see
    no CUDA device (``CUDA_VISIBLE_DEVICES=""``: else vLLM swaps Triton for a placeholder on a machine
    without a driver); both are set for them only, with ``self_check`` (:func:`support.dcp.run_ranks`).
    """
    return dcp.run_ranks(_rank, world, (model_dirs, cases), {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""},
                         timeout, self_check)
