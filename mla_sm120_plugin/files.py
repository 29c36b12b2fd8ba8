"""Reading the files a user points the plugin at: regular files only, size- and nesting-bounded.

Two kinds come through here: a model's HF ``config.json`` (:mod:`.modelinfo`, for ``--model``)
and the plugin's TOML config (:mod:`.config`, for ``--config``, ``MLA_SM120_CONFIG`` and
``config_file``). The bounds and every refusal's text live in this module only; each refusal is a
:class:`~mla_sm120_plugin.errors.ConfigError` that names the path, what it is, and what is accepted.

What a hostile or mistaken path cannot do here:

- block: a FIFO, a device or a socket is refused from ``os.stat`` before anything opens it, and
  the file is opened non-blocking and checked again (``fstat``) in case it was swapped meanwhile;
- exhaust memory: ``/dev/zero`` is a device; a regular file is read with a cap even after the stat
  said it was small (it may grow while we read);
- exhaust the stack: a parse that recurses too deep is refused, as is a parsed value nested deeper
  than :data:`MAX_NESTING`, before any caller walks it or puts its ``repr`` in a message;
- smuggle non-numbers in: JSON's ``NaN``/``Infinity``, floats that overflow to ``inf`` and integers
  longer than :data:`MAX_INT_DIGITS` are refused, the first one named;
- take long: a config.json at the cap is read in about a second whatever its shape (the checks run
  on the text at C speed, not a Python step per value; ``benchmarks/bench_config_read.py``);
- be read differently than the engine reads it: a config.json is UTF-8 without a byte-order mark,
  as transformers (hence vLLM) reads it; anything else is refused here, before the engine would.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import operator
import os
import re
import stat
import sys
from typing import Any

from .errors import ConfigError, format_error

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# The plugin's TOML holds a few settings per model: a few KB even for a long model list.
MAX_TOML_BYTES = 1 << 20
# A HF config.json is a few KB; quantization configs listing every ignored layer reach a few hundred
# KB. 16 MiB leaves wide room for those and still reads in well under a second.
MAX_JSON_BYTES = 16 << 20
# Real configs nest 3-5 levels (quantization_config -> config_groups -> group_0 -> weights). 64 is
# far above that and far below Python's recursion limit, so neither the parsers nor a caller that
# walks or prints the value can recurse out of stack.
MAX_NESTING = 64
# A config's integers fit 64 bits (20 digits); 100 is ample and well under Python's 4300-digit
# int-from-str limit, so the message is ours rather than a hint about sys.set_int_max_str_digits.
MAX_INT_DIGITS = 100

TOML_FILE = "a plugin config TOML file"
JSON_FILE = "a HF config.json"

_READ_CHUNK = 1 << 16
_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe), which would block the read"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


_SURROGATE_ESCAPE = re.compile(r"\\udc([89a-f][0-9a-f])")


def printable(text: str) -> str:
    """``text`` with bytes that were not valid UTF-8 (Python keeps them in paths, ``sys.argv`` and
    ``os.environ`` as lone surrogates) written as ``\\xNN``: printable under any locale, valid in JSON."""
    if text.isascii() or not any(0xDC80 <= ord(c) <= 0xDCFF for c in text):
        return text
    return "".join(f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else c for c in text)


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters; never raises (huge ints, deep nesting)."""
    try:
        # repr() spells an undecodable byte (a lone surrogate) \udcNN; write it as printable() does.
        text = _SURROGATE_ESCAPE.sub(r"\\x\1", repr(value))
    except (ValueError, RecursionError):  # an int over the int-str limit; a self-nested value
        text = f"<{type(value).__name__} too large to print>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n} bytes"


def check_path(path: Any, *, label: str, what: str) -> str:
    """``path`` if the OS can take it as a path; else why not.

    :param label: how messages name the path (``"--config '/x.toml'"``).
    :param what: what the path should be (:data:`TOML_FILE`, :data:`JSON_FILE`).
    :raises ConfigError: not a string, contains a NUL byte, or not encodable for the filesystem.
    """
    if not isinstance(path, str):
        raise ConfigError(format_error(f"{label}: {type(path).__name__} {short_repr(path)}", f"a path to {what}",
                                       "give the path as a string"))
    if "\0" in path:
        raise ConfigError(format_error(f"{label}: the path contains a NUL byte", f"a path to {what}",
                                       "remove the NUL (\\u0000) from the path"))
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:
        raise ConfigError(format_error(f"{label}: the path cannot be encoded for the filesystem ({exc.reason})",
                                       f"a path to {what}", "fix the path's characters")) from None
    return path


def _oserror(exc: OSError, label: str, what: str) -> ConfigError:
    if isinstance(exc, FileNotFoundError):
        return ConfigError(format_error(f"{label}: no such file", f"an existing regular file: {what}", "fix the path"))
    reason = exc.strerror or str(exc)
    return ConfigError(format_error(f"{label}: {reason}", f"a readable regular file: {what}", "fix the path or permissions"))


def _refuse_non_regular(mode: int, size: int, *, label: str, what: str, max_bytes: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((kind for test, kind in _NOT_REGULAR if test(mode)), "not a regular file")
        raise ConfigError(format_error(f"{label}: {kind}", f"a regular file: {what}", "point at the file itself, on disk"))
    if size > max_bytes:
        raise _too_big(size, label=label, what=what, max_bytes=max_bytes)


def _too_big(size: int | None, *, label: str, what: str, max_bytes: int) -> ConfigError:
    given = f"{size} bytes" if size is not None else "more bytes than that"
    return ConfigError(format_error(f"{label}: {given}", f"{what} of at most {_size(max_bytes)}",
                                    "point at the right file; this one is far larger than any config"))


def read_bytes(path: Any, *, label: str, what: str, max_bytes: int) -> bytes:
    """The contents of the regular file at ``path``, at most ``max_bytes`` of them.

    :param label: how messages name the path.
    :param what: what the file should be (:data:`TOML_FILE`, :data:`JSON_FILE`).
    :param max_bytes: the bound (:data:`MAX_TOML_BYTES`, :data:`MAX_JSON_BYTES`).
    :raises ConfigError: a bad path, a missing or unreadable file, not a regular file, too large.
    """
    check_path(path, label=label, what=what)
    try:
        st = os.stat(path)  # before open: opening a FIFO would block until a writer comes
    except OSError as exc:
        raise _oserror(exc, label, what) from None
    _refuse_non_regular(st.st_mode, st.st_size, label=label, what=what, max_bytes=max_bytes)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise _oserror(exc, label, what) from None
    try:
        st = os.fstat(fd)  # the path may have been swapped for a FIFO or device since the stat
        _refuse_non_regular(st.st_mode, st.st_size, label=label, what=what, max_bytes=max_bytes)
        chunks: list[bytes] = []
        total = 0
        while total <= max_bytes:  # the file may have grown since the stat: read one byte past the cap at most
            chunk = os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise _oserror(exc, label, what) from None
    finally:
        os.close(fd)
    if total > max_bytes:
        raise _too_big(None, label=label, what=what, max_bytes=max_bytes)
    return b"".join(chunks)


def _too_deep(label: str, what: str) -> ConfigError:
    return ConfigError(format_error(f"{label}: nested more than {MAX_NESTING} levels deep",
                                    f"{what} nested at most {MAX_NESTING} levels", "point at the right file"))


def check_nesting(value: Any, *, label: str, what: str) -> Any:
    """``value`` if its dicts and lists nest at most :data:`MAX_NESTING` deep (iteratively checked)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []  # a scalar top level nests nothing
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise _too_deep(label, what)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value


class _BadNumber(ValueError):
    pass


def _parse_constant(name: str) -> float:
    raise _BadNumber(f"the non-JSON constant {name}")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadNumber(f"the number {short_repr(text)}, outside the float range")
    return value


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _BadNumber(f"an integer with {len(text.lstrip('-'))} digits")
    return int(text)


_UTF8_BOM = b"\xef\xbb\xbf"
# Text-level checks of a document the C parser accepted (its strings removed, then at most a few
# passes of C string operations over what is left: a Python step per value would cost seconds over
# the millions of values a 16 MiB file can hold).
_BRACKETS_ONLY = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_BRACKET_RUNS = re.compile(rb"\[+|\]+")
# A number token's characters -> "x", the rest -> " ": a run of MAX_INT_DIGITS + 1 "x" is a token
# the per-number checks must read (an integer over the bound; a float needs 309 digits to overflow).
_NUMBER_CHARS = bytes.maketrans(b"0123456789+-.eE", b"x" * 15)
_EXPONENT_CHARS = bytes.maketrans(b"0123456789eE+-", b"9" * 10 + b"EEss")


def _outside_strings(text: str) -> bytes:
    """``text`` without its strings' contents; for a valid JSON document what is left is ASCII (for
    any other text, whatever it is: the parser then refuses the text with its position)."""
    if "\\" in text:  # escaped quotes: drop escape pairs first (\\ before \", so \\" keeps its quote)
        text = text.replace("\\\\", "").replace('\\"', "")
    return "".join(text.split('"')[::2]).encode("ascii", "replace")


def _nesting(skeleton: bytes) -> int:
    """How deep the brackets of ``skeleton`` (a valid document without its strings) nest.

    Innermost ``[]`` pairs are removed while that shrinks the text a lot (bushy documents are gone
    in a few passes); what is left (narrow and deep) is read as runs of opening and closing brackets.
    """
    brackets = skeleton.translate(_BRACKETS_ONLY, _NOT_BRACKETS)
    depth = 0
    while brackets:
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) > len(brackets) * 3 // 4:
            break
        brackets, depth = shorter, depth + 1
    if not brackets:
        return depth
    runs = _BRACKET_RUNS.findall(brackets)  # alternate: [+ ]+ [+ ... (valid JSON starts with [)
    opened = itertools.accumulate(map(len, runs[::2]))
    closed = itertools.chain((0,), itertools.accumulate(map(len, runs[1::2])))
    return depth + max(map(operator.sub, opened, closed))


def _may_hold_a_refused_number(skeleton: bytes) -> bool:
    """Whether a number token of ``skeleton`` could be one the per-number checks refuse: longer than
    :data:`MAX_INT_DIGITS` characters, or with an exponent of three digits or more (1e309)."""
    if b"x" * (MAX_INT_DIGITS + 1) in skeleton.translate(_NUMBER_CHARS):
        return True
    exponents = skeleton.translate(_EXPONENT_CHARS)
    return b"E999" in exponents or b"Es999" in exponents


def _json_refusal(exc: BaseException, label: str) -> ConfigError:
    """The refusal for what the parser raised: a refused number, a recursion too deep, or a syntax error."""
    if isinstance(exc, _BadNumber):
        return ConfigError(format_error(
            f"{label}: {exc}", f"{JSON_FILE}: finite numbers, integers of at most {MAX_INT_DIGITS} digits",
            "write the value as a plain finite number, or point at the model's own config.json",
        ))
    if isinstance(exc, RecursionError):
        return _too_deep(label, JSON_FILE)
    return ConfigError(format_error(
        f"{label}: invalid JSON: {exc}", JSON_FILE,
        "fix the syntax at the position given, or point at the model's config.json",
    ))


def _parse_json_with_hooks(text: str, *, label: str) -> Any:
    """The document parsed with a check on every number as the parser meets it: slow (a Python call
    a number), so only run on a document that may hold a refused number, to name the first one."""
    try:
        return json.loads(text, parse_constant=_parse_constant, parse_float=_parse_float, parse_int=_parse_int)
    except (ValueError, RecursionError) as exc:  # _BadNumber, JSONDecodeError
        raise _json_refusal(exc, label) from None


def parse_json(data: bytes, *, label: str) -> Any:
    """Parse a HF ``config.json``'s bytes: UTF-8 without a byte-order mark, as transformers reads it
    (``open(path, encoding="utf-8")``, then :func:`json.loads`, which refuses a BOM), hence vLLM.

    About a second at :data:`MAX_JSON_BYTES` whatever the shape (many keys, numbers, small or deep
    containers; ``benchmarks/bench_config_read.py``): the C parser runs without per-number
    callbacks and without the cyclic garbage collector, and nesting and numbers are checked on the
    text outside the strings with C string operations. Only a document with a number token that
    could be refused (over :data:`MAX_INT_DIGITS` characters, or a 3-digit exponent) is parsed with
    a check on each number instead (slower: a Python call a number), which names the first one refused.

    :raises ConfigError: a BOM, not UTF-8, not JSON, a non-finite or oversized number, nested too deep.
    """
    if data.startswith(_UTF8_BOM):
        raise ConfigError(format_error(
            f"{label}: starts with a UTF-8 byte-order mark (bytes EF BB BF)",
            f"{JSON_FILE} in UTF-8 without a byte-order mark (transformers' reader, hence vLLM's, "
            "refuses the mark)",
            "re-save the file as UTF-8 without the mark (e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' config.json)",
        ))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(format_error(f"{label}: not UTF-8: {exc}", f"{JSON_FILE} in UTF-8 (as transformers reads it)",
                                       "re-save the file as UTF-8")) from None
    # Millions of small containers set off the cyclic collector over and over (3x the parse); a
    # parsed document holds no cycles, so it has nothing to find meanwhile.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        skeleton = _outside_strings(text)
        if _may_hold_a_refused_number(skeleton):
            value = _parse_json_with_hooks(text, label=label)
        else:
            try:
                value = json.loads(text, parse_constant=_parse_constant)
            except (ValueError, RecursionError) as exc:  # a non-JSON constant, JSONDecodeError, too deep
                raise _json_refusal(exc, label) from None
        if _nesting(skeleton) > MAX_NESTING:
            raise _too_deep(label, JSON_FILE)
        return value
    finally:
        if gc_was_enabled:
            gc.enable()


def parse_toml(data: bytes, *, label: str) -> dict[str, Any]:
    """Parse the plugin config's bytes (UTF-8).

    :raises ConfigError: not UTF-8, not TOML, an integer too long to convert, nested too deep.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(format_error(f"{label}: not UTF-8: {exc}", "a UTF-8 TOML file", "re-save the file as UTF-8")) from None
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise _too_deep(label, TOML_FILE) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(format_error(f"{label}: invalid TOML: {exc}", "TOML 1.0",
                                       "fix the syntax at the position given")) from None
    except ValueError as exc:  # an integer over Python's int-str limit: TOML's integers are 64-bit
        raise ConfigError(format_error(f"{label}: a value too large to read: {str(exc).split(';')[0]}",
                                       "TOML 1.0, whose integers fit in 64 bits", "correct the value")) from None
    return check_nesting(value, label=label, what=TOML_FILE)


def read_json(path: Any, *, label: str) -> Any:
    """A HF ``config.json`` read and parsed within the bounds above."""
    return parse_json(read_bytes(path, label=label, what=JSON_FILE, max_bytes=MAX_JSON_BYTES), label=label)


def read_toml(path: Any, *, label: str) -> dict[str, Any]:
    """The plugin's TOML config read and parsed within the bounds above."""
    return parse_toml(read_bytes(path, label=label, what=TOML_FILE, max_bytes=MAX_TOML_BYTES), label=label)
