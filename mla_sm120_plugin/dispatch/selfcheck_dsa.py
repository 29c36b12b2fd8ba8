"""The DSA family's self-check case: one paged latent cache, top-k slots a token.

The case (:func:`build`) is the engines' call in miniature: the layout's rows written by its packer
with the key's scale format, 64-row pages, the real heads, top-k and q dtype, and adversarial
candidates in token 0 (-1, the first slot past the cache, one far past it, a duplicate) and, where
the caller hands the kernel lengths (:attr:`~mla_sm120_plugin.engines.Engine.call_lengths`), a short
``topk_length`` in token 1. Four latent tiles of different magnitude, so a wrong per-tile scale
shows. For a model with learned sinks the case carries one a head: finite near the rows' LSE (an
output about halved), -inf (none) and +30 (outweighs every score), so a sink dropped or applied
twice shows. The truth (:func:`truth`) is the torch reference on a float64 q, over the rows as the
cache dequantizes them. The runner is :mod:`.selfcheck`.

A decode-context-parallel call (the key's ``lse``: the caller reads the LSE) is built and run as a
rank makes it (:mod:`.dcp`): the owned counts as lengths, with a row that owns nothing (valid ids
beyond a count of 0), a row of only -1, two rows of one request (a draft row sees one id more), the
rank's own heads' sinks (finite near the rows' LSE, +30: the sink dominates every row) and -inf for
the other ranks' heads; the LSE is asked in the engine's base, with the sink folded in as the rank
asks for it and, for a model with sinks, once more without it (the contract's other form), and each
is held to float64's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..engines import for_context
from ..kernels.dsa import layout, pack
from ..kernels.dsa.reference import torch_sparse_mla
from ..types import DECODE, PHASES, PREFILL, Decision
from .dcp import DcpRank, call_sinks, rank_share

NUM_PAGES = 4
ORDER = (DECODE, PREFILL)  # the phases in the order they are checked and logged: decode, which graphs capture, first
# Tokens a call checks, per phase. On a GPU, prefill takes more than 64 tokens: FlashInfer's
# prefill path starts there. The CPU (Triton's interpreter) checks a few tokens per phase.
TOKENS_GPU = {"decode": 2, "prefill": 65}
TOKENS_CPU = {"decode": 2, "prefill": 3}
# A DCP rank's call: the adversarial row, a row owning nothing, a row of only -1 and two rows of one request.
DCP_ROWS = 5
FORMS = ("with sink", "sink-free")  # the LSE forms a DCP case checks: as the rank asks, and the other
_TILE_GAINS = (0.5, 1.0, 2.0, 4.0)  # tiles of different magnitude, so a wrong per-tile scale shows
# `doctor --self-check`'s top-k: GLM-5's on a GPU; on the CPU (Triton's interpreter) a smaller one
# keeps it to seconds.
SWEEP_TOPK = {"gpu": 2048, "cpu": 128}


def adversarial_ids(num_slots: int) -> tuple[int, ...]:
    """The first candidates of token 0 in every case: padding, the first slot past the cache, one far
    past it and a valid slot. The candidate after them repeats the next one (a duplicate counts twice)."""
    return (-1, num_slots, num_slots + 1000, 3)


def build(key: Any, device: torch.device) -> dict[str, Any]:
    """The deterministic inputs of a check, in the geometry the engines pass: 64-row pages.

    Any layout of ``layout.LAYOUTS``: q and the cached tokens are as wide as its ``head_dim`` (576,
    or 512 for GLM-5.3-Flash's rope-less rows), the rows are written by :func:`pack.pack` with the
    key's ``written_format`` (fp8 layouts), reserved bytes as zeros.

    Every tensor is made on the CPU with an explicit dtype, then moved to ``device``: the engines
    build the impl inside their own default device and dtype (vLLM: ``torch.device("cuda")`` and the
    model's bf16), which must change neither the case nor where its generator runs.
    """
    lay = layout.get(key.kv_layout)
    cpu = torch.device("cpu")
    gen = torch.Generator(device=cpu).manual_seed(0)
    num_slots = NUM_PAGES * layout.PAGE_SIZE
    latent = torch.randn(num_slots, lay.head_dim, generator=gen, dtype=torch.float32, device=cpu)  # [S, D]
    gains = torch.tensor(_TILE_GAINS, dtype=torch.float32, device=cpu).repeat_interleave(layout.FP8_TILE)  # [512]
    latent[:, : lay.latent] *= gains
    rows = pack.pack(latent, key.kv_layout, key.written_format or layout.SCALE_ARBITRARY)  # [S, row], uint8 or bf16
    tokens = (TOKENS_GPU if device.type == "cuda" else TOKENS_CPU)[key.phase]
    if key.lse is not None:
        tokens = max(tokens, DCP_ROWS)
    indices = torch.randint(0, num_slots, (tokens, key.topk), generator=gen, dtype=torch.int32, device=cpu)  # [T, topk]
    special = adversarial_ids(num_slots)[: key.topk]
    indices[0, : len(special)] = torch.tensor(special, dtype=torch.int32, device=cpu)
    if key.topk > len(special) + 1:
        indices[0, len(special) + 1] = indices[0, len(special)]  # a duplicate counts twice
    topk_length = torch.full((tokens,), key.topk, dtype=torch.int32, device=cpu)
    if tokens > 1:
        topk_length[1] = max(1, key.topk // 3)
    if key.lse is not None:
        topk_length[1] = 0  # owns nothing; its ids past the count are valid and must not be read
        indices[2] = -1  # a padded row: nothing at all
        indices[4] = indices[3]  # two rows of one request: the draft row sees one id more
        topk_length[3] = max(1, key.topk // 3)
        topk_length[4] = min(key.topk, max(1, key.topk // 3) + 1)
    q = torch.randn(tokens, key.num_heads, lay.head_dim, generator=gen, dtype=torch.float32, device=cpu)  # [T, H, D]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[key.q_dtype]
    case = dict(q=q.to(dtype=dtype, device=device), kv_cache=pack.page_view(rows).to(device),  # [P, 64, C]
                indices=indices.to(device), topk_length=topk_length.to(device) if key.lengths else None,
                sm_scale=lay.head_dim**-0.5, kv_layout=key.kv_layout, sink=None, own_sink=None)
    if key.sinks and key.lse is not None:
        # The rank's own heads (the first 1/dcp of the call's): near the rows' LSE and +30 (dominating), in
        # turn; the other ranks' heads get -inf from the one rule, as the rank's call has them.
        own = torch.randn(key.num_heads // key.dcp, generator=gen, dtype=torch.float32, device=cpu) + math.log(key.topk)
        own[1::2] = 30.0
        case["own_sink"] = own.to(device)  # [H / dcp]
        case["sink"] = call_sinks(case["own_sink"], _rank(key), key.num_heads)  # [H]
    elif key.sinks:
        # about the LSE of top-k unit-scale scores (log top-k): the sink takes about half the weight
        sink = torch.randn(key.num_heads, generator=gen, dtype=torch.float32, device=cpu) + math.log(key.topk)  # [H]
        sink[1::4] = float("-inf")
        sink[2::4] = 30.0
        case["sink"] = sink.to(device)
    return case


def _rank(key: Any) -> DcpRank:
    """The DCP rank whose call a key's case is: the first of ``key.dcp``, its merge reading ``key.lse``."""
    return DcpRank(key.dcp, 0, key.lse)


def _natural(lse: Any, base: str) -> Any:
    """A kernel's LSE in ``base``, in nats (the check compares in one unit)."""
    return lse.double() * (math.log(2.0) if base == "2" else 1.0)


def run(kernel: Any, key: Any, inputs: dict[str, Any]) -> Any:
    """The kernel on the case, as an engine binding calls it (its scale format told where it takes one).

    :returns: out; for a DCP case ``(out, {form: lse in nats})``: the rank's call through the one home
        (:func:`~mla_sm120_plugin.dispatch.dcp.rank_share`), and for a model with sinks the same call
        asking the sink-free LSE.
    """
    def call(q: Any, slots: Any, **contract: Any) -> Any:
        return kernel.call(q, inputs["kv_cache"], slots, sm_scale=inputs["sm_scale"], kv_layout=key.kv_layout,
                           scale_format=key.scale_format, **contract)

    if key.lse is None:
        return call(inputs["q"], inputs["indices"], topk_length=inputs["topk_length"],
                    **({} if inputs["sink"] is None else {"sink": inputs["sink"]}))
    out, lse = rank_share(call, inputs["q"], inputs["indices"], inputs["topk_length"], rank=_rank(key),
                          sinks=inputs["own_sink"])
    lses = {FORMS[0]: _natural(lse, key.lse)}
    if inputs["sink"] is not None:
        _, free = call(inputs["q"], inputs["indices"], topk_length=inputs["topk_length"], sink=inputs["sink"],
                       return_lse=True, lse_base=key.lse)
        lses[FORMS[1]] = _natural(free, key.lse)
    return out, lses


def truth(key: Any, inputs: dict[str, Any]) -> Any:
    """Float64 attention over the case's dequantized rows (the reference computes in float64 for a
    float64 q), so only the kernel's own arithmetic counts; for a DCP case with its float64 LSEs
    (natural log; the sink-free form is compared with the sink folded into both sides: :func:`measure_lse`)."""
    def reference(**lse: Any) -> Any:
        return torch_sparse_mla(inputs["q"].double(), inputs["kv_cache"], inputs["indices"],
                                sm_scale=inputs["sm_scale"], kv_layout=key.kv_layout,
                                topk_length=inputs["topk_length"], sink=inputs["sink"], **lse)

    if key.lse is None:
        return reference()
    out, folded = reference(return_lse=True, lse_with_sink=True)
    want = {FORMS[0]: (folded, None)}
    if inputs["sink"] is not None:
        want[FORMS[1]] = (reference(return_lse=True)[1], inputs["sink"])
    return out, want


def keys(decision: Decision, phase: str, kernel: str, *, q_dtype: str, device: str) -> list[dict[str, Any]]:
    """What proves ``kernel`` for ``phase`` of ``decision`` (the runner's ``CheckKey`` fields): the
    decision's layout, heads and top-k.

    A kernel told "arbitrary" must also read power-of-two scales right: vLLM 0.33's DSA cache writer
    stores pow2 scales for every model, GLM included, and GLM-5.3-Flash's rope-less rows
    (concat_and_cache_mla) may hold either. One told "pow2" reads only pow2.

    The call is the engine's: per-row lengths where it hands them over (:attr:`Engine.call_lengths`);
    under decode context parallelism a rank's call, its LSE read in the base the engine's merge reads.
    """
    ctx = decision.context
    engine = for_context(ctx)
    dcp = ctx.decode_context_parallel_size
    written = [decision.scale_format]
    if ctx.kv_cache_dtype in layout.FP8_LAYOUTS and decision.scale_format == layout.SCALE_ARBITRARY:
        written.append(layout.SCALE_POW2)
    return [dict(kernel=kernel, phase=phase, kv_layout=ctx.kv_cache_dtype, num_heads=ctx.num_heads, device=device,
                 q_dtype=q_dtype, scale_format=decision.scale_format, written_format=fmt, topk=ctx.index_topk,
                 sinks=ctx.sinks, lengths=dcp > 1 or engine.call_lengths,
                 lse=engine.dcp.lse_base if dcp > 1 else None, dcp=dcp)
            for fmt in written]


# `doctor --self-check`'s decode-context-parallel case for a kernel that returns its LSE: a rank of two,
# with sinks, read in natural log (what vLLM's merge is told; SGLang's base 2 is the same call's lse_scale).
SWEEP_DCP = dict(sinks=True, lse="e", dcp=2)


def sweep_keys(name: str, spec: Any, *, num_heads: int, device: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``doctor --self-check``'s keys for a DSA kernel (``CheckKey`` fields): each layout it reads, both
    scale formats on the 656-byte fp8 layout, each phase; a kernel that returns its LSE is checked on
    decode as a DCP rank calls it (:data:`SWEEP_DCP`: its LSE too). With the row fields as ``doctor``
    shows them."""
    topk = SWEEP_TOPK["gpu" if device.startswith("cuda") else "cpu"]
    out = []
    for kv_layout in sorted(spec.kv_cache_dtypes):
        formats = layout.SCALE_FORMATS if kv_layout == layout.FP8_DS_MLA else (layout.SCALE_ARBITRARY,)
        for scale_format in formats:
            for phase in (p for p in sorted(PHASES) if p in spec.phases):
                dcp = SWEEP_DCP if phase == DECODE and spec.returns_lse else {}
                key = dict(kernel=name, phase=phase, kv_layout=kv_layout, num_heads=num_heads, device=device,
                           scale_format=scale_format, written_format=scale_format, topk=topk, **dcp)
                out.append((key, dict(scale_format=scale_format if kv_layout == layout.FP8_DS_MLA else None,
                                      topk=topk, lse=dcp.get("lse"))))
    return out
