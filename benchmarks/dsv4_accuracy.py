"""DeepSeek-V4 attention accuracy: the torch reference and the Triton kernel against float64 over the
dequantized rows (FlashMLA's metrics, docs/facts.md#accuracy-metrics-and-regimes: cos_diff, relRMS, max |out - ref| / max |ref|), in the regimes
the DSA kernels are measured in: flat (q ~ randn / 10, half the window ids -1), peaked (q ~ randn,
softmax scale 512^-0.5: a few candidates dominate), few candidates (5 window slots a row, no
compressed ones), each with per-head sinks of each kind (finite, -inf, large: 30, which takes
nearly all the mass) and duplicate ids (a window id and a compressed id repeated), a C4A-like layer
(128 window slots, 512 compressed slots, 64-entry pages), on the CPU (Triton's interpreter) or a
GPU; for each cache record (the 584-byte fp8 one, the 384-byte NVFP4 one), written from the same
bf16 rows. The Triton kernel runs on its plan and forced to each ``--splits`` count. Besides each
kernel's error against float64 over the record's dequantized rows, ``record_cost`` is what the
record itself costs: float64 attention over its dequantized rows against float64 attention over the
bf16 rows it was written from (a bf16 cache's cost is 0 by this measure).

    python benchmarks/dsv4_accuracy.py [--tokens 2] [--heads 16] [--seeds 2] [--records fp8_dsv4,nvfp4_dsv4]
                                       [--splits 1,3,64] [--sinks finite,-inf,large] [--json out.json]

Prints one JSON object: {"records": {record: {"record_cost": {regime: {cos_diff, rel_rms, max_rel}},
"kernels": {kernel: {regime: {...}}}}}} (the worst over seeds and sink kinds; the kernels:
"reference", "triton_dsv4" on its plan, "triton_dsv4 splits=N").
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from mla_sm120_plugin.kernels.accuracy import measure  # noqa: E402
from mla_sm120_plugin.kernels.dsv4 import layout, pack  # noqa: E402
from mla_sm120_plugin.kernels.dsv4.reference import dsv4_attention_reference  # noqa: E402

SCALE = 512**-0.5
REGIMES = ("flat", "peaked", "few")
SINKS = ("finite", "-inf", "large")


def _sinks(kind: str, heads: int, gen: torch.Generator) -> torch.Tensor:
    return {"finite": lambda: torch.randn(heads, generator=gen), "-inf": lambda: torch.full((heads,), float("-inf")),
            "large": lambda: torch.full((heads,), 30.0)}[kind]()


def _case(regime: str, tokens: int, heads: int, seed: int, device: str, record: layout.Dsv4Record,
          sink_kind: str = "finite"):
    gen = torch.Generator().manual_seed(seed)
    window_page, extra_page, window, extra = 64, 64, 128, 512
    swa, comp = pack.new_cache(4, window_page, record=record), pack.new_cache(12, extra_page, record=record)
    originals = []
    for cache, page in ((swa, window_page), (comp, extra_page)):
        slots = torch.arange(cache.shape[0] * page)
        rows = torch.randn(slots.numel(), 512, generator=gen).to(torch.bfloat16)
        pack.write(cache, rows, slots, page, record)
        originals.append(rows)
    q = torch.randn(tokens, heads, 512, generator=gen) * (0.1 if regime == "flat" else 1.0)
    swa_idx = torch.randint(0, 4 * window_page, (tokens, window), generator=gen, dtype=torch.int32)
    comp_idx = torch.randint(0, 12 * extra_page, (tokens, extra), generator=gen, dtype=torch.int32)
    swa_idx[:, 1], comp_idx[:, 1] = swa_idx[:, 0], comp_idx[:, 0]  # duplicate ids: each position counts
    if regime == "flat":
        swa_idx[:, 2::2] = -1
    swa_len = torch.full((tokens,), 5 if regime == "few" else window, dtype=torch.int32)
    comp_len = torch.full((tokens,), 0 if regime == "few" else extra, dtype=torch.int32)
    sinks = _sinks(sink_kind, heads, gen)
    tensors = [t.to(device) for t in (q.to(torch.bfloat16), swa, swa_idx, swa_len, comp, comp_idx, comp_len, sinks)]
    return tensors, (window_page, extra_page), originals


def _truth(q, swa, swa_idx, swa_len, comp, comp_idx, comp_len, sinks, pages, record,
           originals=None) -> torch.Tensor:
    """float64 attention over the dequantized rows (sink in the denominator, masked slots skipped);
    over the bf16 rows the caches were written from when ``originals`` is given."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        rows = []
        for part, (cache, idx, n, page) in enumerate(((swa, swa_idx, swa_len, pages[0]),
                                                      (comp, comp_idx, comp_len, pages[1]))):
            ids = idx[t, : int(n[t])].cpu()
            ids = ids[(ids >= 0) & (ids < cache.shape[0] * page)]
            if ids.numel():
                rows.append(originals[part][ids.long()].double() if originals is not None
                            else pack.gather(cache.cpu(), ids, page, record).double())
        if not rows:
            continue
        keys = torch.cat(rows)
        scores = q[t].double().cpu() @ keys.T * SCALE
        top = torch.maximum(scores.amax(-1), sinks.double().cpu())
        w = torch.exp(scores - top[:, None])
        out[t] = (w @ keys) / (w.sum(-1) + torch.exp(sinks.double().cpu() - top))[:, None]
    return out


def _worst(into: dict[str, dict[str, float]], regime: str, acc) -> None:
    worst = into.setdefault(regime, {"cos_diff": 0.0, "rel_rms": 0.0, "max_rel": 0.0})
    for key in worst:
        worst[key] = max(worst[key], float(getattr(acc, key)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--records", default=",".join(layout.ALL_RECORDS),
                        help=f"comma-separated, of {sorted(layout.ALL_RECORDS)}")
    parser.add_argument("--splits", default="1,3,64", help="forced split counts the Triton kernel also runs")
    parser.add_argument("--sinks", default=",".join(SINKS), help=f"comma-separated, of {list(SINKS)}")
    parser.add_argument("--json", help="also write the JSON here")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from functools import partial

    from mla_sm120_plugin.kernels.dsv4.triton import dsv4_attention

    kernels = {"reference": dsv4_attention_reference, "triton_dsv4": dsv4_attention}
    kernels.update({f"triton_dsv4 splits={n}": partial(dsv4_attention, num_splits=int(n))
                    for n in filter(None, args.splits.split(","))})
    result: dict[str, dict] = {}
    for name in args.records.split(","):
        record = layout.ALL_RECORDS[name]
        entry = result[name] = {"token_bytes": record.token_bytes, "record_cost": {},
                                "kernels": {k: {} for k in kernels}}
        for regime in REGIMES:
            for seed, sink_kind in ((s, k) for s in range(args.seeds) for k in args.sinks.split(",")):
                (q, swa, swa_idx, swa_len, comp, comp_idx, comp_len, sinks), pages, originals = _case(
                    regime, args.tokens, args.heads, seed, device, record, sink_kind)
                parts = (q, swa, swa_idx, swa_len, comp, comp_idx, comp_len, sinks, pages, record)
                truth = _truth(*parts)
                _worst(entry["record_cost"], regime, measure(truth, _truth(*parts, originals=originals)))
                for kernel, fn in kernels.items():
                    out = fn(q, swa, swa_idx, pages[0], sm_scale=SCALE, swa_lengths=swa_len, extra_cache=comp,
                             extra_indices=comp_idx, extra_lengths=comp_len, extra_page_size=pages[1], sinks=sinks,
                             record=record)
                    _worst(entry["kernels"][kernel], regime, measure(out.cpu(), truth))
    text = json.dumps({"device": device, "tokens": args.tokens, "heads": args.heads, "seeds": args.seeds,
                       "sinks": args.sinks.split(","), "records": result}, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
