"""What an NVFP4 KV cache costs in attention accuracy: nvfp4_ds_mla vs fp8_ds_mla vs bf16.

For each model's softmax scale, random tokens (512 latent + 64 rope, each token its own magnitude)
are written into each cache by the plugin's packer (vLLM's writers, bit for bit for nvfp4; pow2
scales for fp8_ds_mla, what vLLM's DSA writer stores for every model), read back with the layout's
dequantizer, and sparse attention over them is computed in float64; the truth is the same
attention in float64 over the unquantized tokens. CPU only (torch).

    python benchmarks/nvfp4_accuracy.py [--json] [--seeds 3] [--topk 2048] [--heads 16]

Prints a Markdown table (or JSON with --json): per model and cache, the output error in FlashMLA's
metrics (mla_sm120_plugin.kernels.accuracy: cos_diff, relRMS, and the max error relative to the
truth's largest |value|; the worst over the seeds), and the bytes a token.

Softmax scales (the model's ``layer.scaling``, docs/facts.md#softmax-scales): GLM-5 (qk_nope 192 + rope 64,
no YaRN) 256 ** -0.5; DeepSeek-V3.2 (qk_nope 128 + rope 64, YaRN factor 40 with mscale_all_dim 1,
scaling *= mscale ** 2, mscale = 0.1 * ln(40) + 1) 192 ** -0.5 * mscale ** 2.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from mla_sm120_plugin.kernels.accuracy import measure as metrics
from mla_sm120_plugin.kernels.dsa import layout, pack

_MSCALE = 0.1 * math.log(40.0) + 1.0
MODELS = {
    "GLM-5": 256**-0.5,
    "DeepSeek-V3.2": 192**-0.5 * _MSCALE**2,
}
CACHES = (layout.BF16, layout.FP8_DS_MLA, layout.NVFP4_DS_MLA)


def tokens(num: int, gen: torch.Generator) -> torch.Tensor:
    """[num, 576] float32: unit-normal values, each token scaled by 2**U(-1, 1) (per-token magnitudes,
    as RMS-normed latents times learned norm weights vary), a few channels 4x louder (outliers)."""
    x = torch.randn(num, layout.HEAD_DIM, generator=gen)
    x *= torch.exp2(torch.empty(num, 1).uniform_(-1, 1, generator=gen))
    loud = torch.randperm(layout.KV_LORA_RANK, generator=gen)[:16]
    x[:, loud] *= 4.0
    return x


def attention64(q: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """out [T, H, 512] float64 of q [T, H, 576] over keys [S, 576] at indices [T, topk] (all valid)."""
    k = keys.double()[indices.long()]  # [T, topk, 576]
    s = sm_scale * torch.einsum("thd,tkd->thk", q.double(), k)
    return torch.einsum("thk,tkd->thd", torch.softmax(s, dim=-1), k[..., : layout.KV_LORA_RANK])


def measure(sm_scale: float, seed: int, *, num_slots: int, topk: int, heads: int, num_tokens: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    latent = tokens(num_slots, gen)
    q = torch.randn(num_tokens, heads, layout.HEAD_DIM, generator=gen).to(torch.bfloat16).float()
    indices = torch.stack([torch.randperm(num_slots, generator=gen)[:topk] for _ in range(num_tokens)])
    truth = attention64(q, latent, indices, sm_scale)
    result = {}
    for cache in CACHES:
        rows = pack.pack(latent, cache, layout.SCALE_POW2)
        got = metrics(attention64(q, pack.dequantize(rows, cache), indices, sm_scale), truth)
        result[cache] = dict(cos_diff=got.cos_diff, rel_rms=got.rel_rms, max_rel=got.max_rel)
    return result


def run(seeds: int, topk: int, heads: int, num_tokens: int = 4) -> dict:
    num_slots = max(2 * topk, 256)
    table = {}
    for model, sm_scale in MODELS.items():
        runs = [measure(sm_scale, seed, num_slots=num_slots, topk=topk, heads=heads, num_tokens=num_tokens)
                for seed in range(seeds)]
        table[model] = dict(sm_scale=sm_scale, caches={
            cache: dict(token_bytes=layout.TOKEN_BYTES[cache],
                        **{key: max(r[cache][key] for r in runs) for key in ("cos_diff", "rel_rms", "max_rel")})
            for cache in CACHES})
    return dict(seeds=seeds, topk=topk, heads=heads, tokens=num_tokens, slots=num_slots, models=table)


def markdown(report: dict) -> str:
    lines = ["| model (softmax scale) | KV cache | bytes/token | tokens/GiB vs fp8_ds_mla | cos_diff | relRMS | max error |",
             "|---|---|---|---|---|---|---|"]
    for model, row in report["models"].items():
        for cache, c in row["caches"].items():
            ratio = layout.TOKEN_BYTES[layout.FP8_DS_MLA] / c["token_bytes"]
            lines.append(f"| {model} ({row['sm_scale']:.4f}) | {cache} | {c['token_bytes']} | {ratio:.2f}x | "
                         f"{c['cos_diff']:.2e} | {100 * c['rel_rms']:.3f} % | {100 * c['max_rel']:.3f} % |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args(argv)
    report = run(args.seeds, args.topk, args.heads)
    print(json.dumps(report, indent=1) if args.json else markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
