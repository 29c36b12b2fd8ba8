"""FlashInfer's SM120 sparse-MLA envelope as packaged data, one table per FlashInfer version.

The envelope the selection checks (head counts, top-k, the decode token limit, the prefill head
set and top-k tile) is data in ``flashinfer_envelope.json`` next to this module, so deciding a
kernel never imports flashinfer or torch, and an install without flashinfer decides as one with
it. Reading the table costs one small JSON file, once per process.

Which table: the one for the installed ``flashinfer-python`` version (found with
:mod:`importlib.metadata`, without importing it); if flashinfer is not installed or its version has
no table, the newest packaged one, and :func:`table_note` says so in one line.

Where the facts come from (``--dump`` reads them all from the installed flashinfer):

- ``decode``: ``flashinfer.mla.supported_sparse_mla_sm120_configs(kv_cache_format="fp8")``, every
  field of every family, frozensets as sorted lists. That table describes calls of up to
  ``max_num_tokens`` query tokens (the decode kernels). ``decode_nvfp4``: the same call with
  ``kv_cache_format="nvfp4"`` (the 384-byte DeepSeek-V4 record's kernels).
- ``prefill``: longer calls run the prefill kernels, whose limits no public API reports:
  ``heads`` from ``visit_prefill_heads`` in
  ``data/include/flashinfer/attention/sparse_mla_sm120/execution/attention_plan.h`` (the
  inline-scale families: SG 8/16, MG 32/64/128, swapAB 64/128), ``topk_tile`` from
  ``flashinfer.mla._sparse_mla_sm120._policy._BI`` (``attention_resolve.cu`` needs
  ``topk % 64 == 0``, dense indices and back-to-back pages).

A new FlashInfer version is one command in an environment that has it installed::

    python -m mla_sm120_plugin.dispatch.flashinfer_table --write   # adds/replaces its table
    python -m mla_sm120_plugin.dispatch.flashinfer_table --dump    # prints it, writes nothing

``tests/dispatch/test_flashinfer_contract.py`` fails while the installed version's table differs
from what that version reports.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

PIP_PACKAGE = "flashinfer-python"
DATA_FILE = Path(__file__).with_name("flashinfer_envelope.json")
SCHEMA = 1
REGENERATE = "python -m mla_sm120_plugin.dispatch.flashinfer_table --write"

# Relative to the installed flashinfer package: where --dump reads the prefill head set.
_PREFILL_PLAN_HEADER = "data/include/flashinfer/attention/sparse_mla_sm120/execution/attention_plan.h"

# Written into the data file, which JSON cannot comment.
_SOURCES = {
    "decode": "flashinfer.mla.supported_sparse_mla_sm120_configs(kv_cache_format='fp8'): every field of every "
    "family; sets as sorted lists; describes calls of <= max_num_tokens query tokens",
    "decode_nvfp4": "the same with kv_cache_format='nvfp4' (the 384-byte DeepSeek-V4 record)",
    "prefill.heads": f"visit_prefill_heads in flashinfer/{_PREFILL_PLAN_HEADER} (calls over max_num_tokens)",
    "prefill.topk_tile": "flashinfer.mla._sparse_mla_sm120._policy._BI: prefill needs topk % topk_tile == 0",
}


@dataclass(frozen=True)
class DecodeConfig:
    """One family of ``supported_sparse_mla_sm120_configs()``, as packaged (same field names)."""

    d_qk: int
    page_block_size: int
    max_num_tokens: int
    topks: frozenset[int]
    min_topk: int
    max_num_heads: int
    kv_cache_format: str = "fp8"
    bytes_per_token: int = 0
    head_counts: frozenset[int] | None = None
    topk_is_runtime: bool = True
    extra_page_block_sizes: frozenset[int] = frozenset()
    page_block_sizes: frozenset[int] = frozenset()
    page_block_size_is_runtime: bool = False

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> DecodeConfig:
        """From a JSON entry (lists for sets); keys this class does not know are ignored."""
        known = {f.name for f in fields(cls)}
        values = {k: frozenset(v) if isinstance(v, list) else v for k, v in entry.items() if k in known}
        return cls(**values)

    def supported_num_heads(self) -> tuple[int, ...]:
        """Sorted head counts, as FlashInfer's method of the same name."""
        if self.head_counts is not None:
            return tuple(sorted(self.head_counts))
        return tuple(range(1, self.max_num_heads + 1))


@dataclass(frozen=True)
class EnvelopeTable:
    """FlashInfer's SM120 sparse-MLA envelope for one ``flashinfer-python`` version.

    :param flashinfer_version: the version these facts were read from.
    :param decode: family name (``"dsv3_2"``, ``"glm_nsa"``, ...) -> its decode configuration.
    :param decode_nvfp4: the same for the NVFP4 caches (``"dsv4"``: the 384-byte record); empty for a
        version whose table was written without them.
    :param prefill_heads: head counts the prefill kernels (calls over ``max_num_tokens``) exist for.
    :param prefill_topk_tile: the prefill kernels need ``topk % prefill_topk_tile == 0``.
    """

    flashinfer_version: str
    decode: Mapping[str, DecodeConfig]
    prefill_heads: frozenset[int]
    prefill_topk_tile: int
    decode_nvfp4: Mapping[str, DecodeConfig] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_entry(cls, version: str, entry: Mapping[str, Any]) -> EnvelopeTable:
        return cls(
            flashinfer_version=version,
            decode={family: DecodeConfig.from_entry(cfg) for family, cfg in entry["decode"].items()},
            prefill_heads=frozenset(entry["prefill"]["heads"]),
            prefill_topk_tile=int(entry["prefill"]["topk_tile"]),
            decode_nvfp4={family: DecodeConfig.from_entry(cfg) for family, cfg in entry.get("decode_nvfp4", {}).items()},
        )


# ------------------------------------------------------------------------ lookup


@functools.cache
def packaged_entries() -> dict[str, dict[str, Any]]:
    """Every packaged table, as JSON entries keyed by flashinfer-python version."""
    data = json.loads(DATA_FILE.read_text(encoding="utf-8"))
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{DATA_FILE.name}: schema {data.get('schema')!r}, this module reads schema {SCHEMA}")
    return data["versions"]


def packaged_versions() -> tuple[str, ...]:
    """The flashinfer-python versions with a packaged table, oldest first."""
    return tuple(sorted(packaged_entries(), key=version_key))


@functools.cache
def installed_version() -> str | None:
    """The installed flashinfer-python's version from its metadata (flashinfer is not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PIP_PACKAGE)
    except PackageNotFoundError:
        return None


@functools.cache
def table() -> EnvelopeTable:
    """The installed version's table, else the newest packaged one (:func:`table_note` says which)."""
    entries = packaged_entries()
    version = installed_version()
    if version not in entries:
        version = packaged_versions()[-1]
    return EnvelopeTable.from_entry(version, entries[version])


def table_note() -> str | None:
    """One line naming the FlashInfer facts used when they are not the installed version's; else None."""
    installed = installed_version()
    if installed in packaged_entries():
        return None
    used = f"FlashInfer envelope from the packaged table of {PIP_PACKAGE} {table().flashinfer_version}"
    if installed is None:
        return f"{used} (flashinfer not installed here)"
    return f"{used} ({PIP_PACKAGE} {installed} is installed here and has no packaged table; {REGENERATE})"


def clear_caches() -> None:
    """Forget the loaded data and the installed version (for tests)."""
    packaged_entries.cache_clear()
    installed_version.cache_clear()
    table.cache_clear()


_VERSION = re.compile(r"(\d+(?:\.\d+)*)(?:(a|b|rc)(\d+))?(?:\.post(\d+))?(?:\.dev(\d+))?")
_PRE_RANK = {"a": 0, "b": 1, "rc": 2, None: 3}


def version_key(version: str) -> tuple:
    """Sort key for PEP 440 versions of the forms FlashInfer publishes (``0.7.2``, ``0.7.2rc1``,
    ``0.7.2.post1``, ``0.8.0.dev3``); a local label (``+cu128``) is ignored. No ``packaging``
    dependency: the core install has only pluggy."""
    match = _VERSION.match(version.strip().lower().lstrip("v"))
    if match is None:
        return ((), 0, 0, -1, 0)
    release, pre, pre_n, post, dev = match.groups()
    numbers = tuple(int(x) for x in release.split("."))
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers = numbers[:-1]  # 0.8 == 0.8.0
    pre_rank = _PRE_RANK[pre]
    if dev is not None and pre is None and post is None:
        pre_rank = -1  # 0.8.0.dev3 < 0.8.0a1
    dev_rank = (0, int(dev)) if dev is not None else (1, 0)  # .devN sorts before what it develops
    return (numbers, pre_rank, int(pre_n or 0), int(post) if post is not None else -1, dev_rank)


# -------------------------------------------------------------------------- dump


def config_entry(config: Any) -> dict[str, Any]:
    """A FlashInfer ``SparseMLASm120DecodeConfig`` (any dataclass) as a JSON entry, every field."""
    entry: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        entry[f.name] = sorted(value) if isinstance(value, (set, frozenset)) else value
    return entry


def dump_entry() -> tuple[str, dict[str, Any]]:
    """(version, table entry) read from the installed flashinfer; imports it (and torch).

    Raises ``RuntimeError`` naming the source file or attribute when a prefill fact cannot be
    found where 0.7.2.post1 keeps it: read the new sources and update this function.
    """
    import flashinfer
    import flashinfer.mla as fi_mla

    version = installed_version() or flashinfer.__version__
    def families(kv_cache_format: str) -> dict[str, Any]:
        configs = fi_mla.supported_sparse_mla_sm120_configs(kv_cache_format=kv_cache_format)
        return {family: config_entry(configs[family]) for family in sorted(configs)}

    return version, {"decode": families("fp8"), "decode_nvfp4": families("nvfp4"),
                     "prefill": _prefill_facts(Path(flashinfer.__file__).parent)}


def _prefill_facts(flashinfer_dir: Path) -> dict[str, Any]:
    try:
        from flashinfer.mla._sparse_mla_sm120 import _policy

        topk_tile = int(_policy._BI)
    except (ImportError, AttributeError) as error:
        raise RuntimeError(f"flashinfer.mla._sparse_mla_sm120._policy._BI (the prefill top-k tile): {error}") from error
    header = flashinfer_dir / _PREFILL_PLAN_HEADER
    try:
        text = header.read_text()
        body = text.split("PrefillLaunchResult visit_prefill_heads", 1)[1].split("#undef HEAD", 1)[0]
    except (OSError, IndexError) as error:
        raise RuntimeError(f"{header}: visit_prefill_heads ... #undef HEAD not found ({error})") from error
    heads = sorted({int(h) for h in re.findall(r"HEAD\((\d+)\)", body)})
    if not heads:
        raise RuntimeError(f"{header}: no HEAD(n) in visit_prefill_heads")
    return {"heads": heads, "topk_tile": topk_tile}


def write_entry(version: str, entry: dict[str, Any], path: Path = DATA_FILE) -> None:
    """Add or replace ``version``'s table in the data file (other versions are kept)."""
    old = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    versions = {**old.get("versions", {}), version: entry}
    data = {
        "schema": SCHEMA,
        "package": PIP_PACKAGE,
        "generated_by": REGENERATE,
        "sources": _SOURCES,
        "versions": {v: versions[v] for v in sorted(versions, key=version_key)},
    }
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="FlashInfer's SM120 sparse-MLA envelope as packaged data")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--dump", action="store_true", help="print the installed flashinfer's table as JSON")
    action.add_argument("--write", action="store_true", help=f"add/replace it in {DATA_FILE.name}")
    args = parser.parse_args(argv)
    version, entry = dump_entry()
    if args.dump:
        print(json.dumps({version: entry}, indent=2))
    else:
        write_entry(version, entry)
        print(f"{DATA_FILE}: wrote the table of {PIP_PACKAGE} {version}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
