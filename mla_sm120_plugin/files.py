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
  longer than :data:`MAX_INT_DIGITS` are refused while parsing.
"""

from __future__ import annotations

import json
import math
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


def parse_json(data: bytes, *, label: str) -> Any:
    """Parse a HF ``config.json``'s bytes (UTF-8/16/32, as :func:`json.loads` detects).

    :raises ConfigError: not JSON, a non-finite or oversized number, nested too deep.
    """
    try:
        value = json.loads(data, parse_constant=_parse_constant, parse_float=_parse_float, parse_int=_parse_int)
    except _BadNumber as exc:
        raise ConfigError(format_error(
            f"{label}: {exc}", f"{JSON_FILE}: finite numbers, integers of at most {MAX_INT_DIGITS} digits",
            "write the value as a plain finite number, or point at the model's own config.json",
        )) from None
    except RecursionError:
        raise _too_deep(label, JSON_FILE) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(format_error(
            f"{label}: invalid JSON: {exc}", JSON_FILE,
            "fix the syntax at the position given, or point at the model's config.json",
        )) from None
    return check_nesting(value, label=label, what=JSON_FILE)


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
