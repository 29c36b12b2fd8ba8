"""How long ``mla-sm120 check`` takes on a config.json at the reader's size cap, by the file's shape.

``python benchmarks/bench_config_read.py [--mib 16] [--repeat 3] [--json]``

Each shape is a GLM-5 config.json padded to ``--mib`` MiB (default: the cap, files.MAX_JSON_BYTES)
with one kind of filler: many keys, many numbers, many small containers, deep but narrow nesting,
long strings. For each: the best of ``--repeat`` wall times of ``files.parse_json`` in this process
and of a whole ``mla-sm120 check --model DIR --sm 12.0`` in a fresh one (what a user waits for),
and the verdict (``ok`` or the first line of the refusal). Output: a table, or JSON with ``--json``.
The files are written to a temporary directory and removed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mla_sm120_plugin import files  # noqa: E402

HEAD = ('{"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "num_attention_heads": 64, '
        '"index_topk": 2048, "kv_lora_rank": 512, "qk_rope_head_dim": 64, ')


def _fill(size: int, item: Callable[[int], str], key: str = '"filler": [', close: str = "]}") -> str:
    """HEAD, then ``key``, then items until the document is at most ``size`` bytes, then ``close``."""
    parts, used, i = [HEAD, key], len(HEAD) + len(key) + len(close), 0
    while True:
        piece = item(i) + ","
        if used + len(piece) > size:
            break
        parts.append(piece)
        used += len(piece)
        i += 1
    if parts[-1].endswith(","):
        parts[-1] = parts[-1][:-1]
    return "".join(parts) + close


SHAPES: dict[str, Callable[[int], str]] = {
    "many keys (int values)": lambda n: _fill(n, lambda i: f'"k{i}": {i}', key='"filler": {', close="}}"),
    "many keys (dict values)": lambda n: _fill(n, lambda i: f'"k{i}": {{"a": {i}}}', key='"filler": {', close="}}"),
    "many small ints": lambda n: _fill(n, lambda i: "0"),
    "many floats": lambda n: _fill(n, lambda i: "0.5"),
    "many empty lists": lambda n: _fill(n, lambda i: "[]"),
    "many empty objects": lambda n: _fill(n, lambda i: "{}"),
    "many short strings": lambda n: _fill(n, lambda i: '"a"'),
    "narrow and 63 deep": lambda n: _fill(n, lambda i: "[" * 62 + "]" * 62),
    "one long string": lambda n: HEAD + '"filler": "' + "x" * (n - len(HEAD) - 14) + '"}',
    "small ints, one 101-digit int": lambda n: _fill(n - 110, lambda i: "0", close=", " + "9" * 101 + "]}"),
}


def _best(fn: Callable[[], object], repeat: int) -> tuple[float, str]:
    best, verdict = float("inf"), ""
    for _ in range(repeat):
        start = time.perf_counter()
        verdict = str(fn())
        best = min(best, time.perf_counter() - start)
    return best, verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=files.MAX_JSON_BYTES / (1 << 20))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    size = int(args.mib * (1 << 20))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in SHAPES.items():
            data = make(size).encode()
            model = Path(tmp) / "model"
            model.mkdir(exist_ok=True)
            (model / "config.json").write_bytes(data)

            def parse() -> str:
                try:
                    files.parse_json(data, label="config.json")
                    return "ok"
                except Exception as exc:  # noqa: BLE001 - the verdict is what this reports
                    return str(exc).splitlines()[0]

            def check() -> str:
                done = subprocess.run([sys.executable, "-m", "mla_sm120_plugin.cli", "check", "--model", str(model),
                                       "--sm", "12.0"], capture_output=True, text=True, env=env)
                return f"exit {done.returncode}"

            parse_s, verdict = _best(parse, args.repeat)
            check_s, exit_code = _best(check, args.repeat)
            rows.append(dict(shape=name, bytes=len(data), parse_seconds=round(parse_s, 3),
                             check_seconds=round(check_s, 3), check=exit_code, verdict=verdict))
    if args.json:
        print(json.dumps(dict(cap_bytes=files.MAX_JSON_BYTES, python=sys.version.split()[0], rows=rows), indent=1))
    else:
        print(f"{'shape':32} {'MiB':>5} {'parse s':>8} {'check s':>8}  check   verdict")
        for r in rows:
            print(f"{r['shape']:32} {r['bytes'] / (1 << 20):5.1f} {r['parse_seconds']:8.2f} {r['check_seconds']:8.2f}  "
                  f"{r['check']:7} {r['verdict'][:60]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
