"""README.md is a user's page: one screen and a bit, install / check / serve on its first screen, its
commands true, and every link in it and in the docs it moved its depth to (docs/*.md) resolving.

The settings table README holds is tests/unit/test_envs.py's.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The pages README's text moved to (issue 42): their links are checked with README's.
MOVED_TO = ("architecture.md", "models.md", "testing.md")
MAX_LINES = 280
FIRST_SCREEN = 40

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CITED_SECTION = re.compile("README" + r' "([^"]+)"')  # split, so this line cites nothing


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (a ``# comment`` in a bash or TOML block is no heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _code_blocks(text: str) -> list[list[str]]:
    blocks, current = [], None
    for line in text.splitlines():
        if _FENCE.match(line):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, spaces and
    hyphens stay), each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, a repeated heading's with GitHub's -1, -2 suffixes."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        anchor = github_anchor(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    """The targets of a markdown file's inline links that are not URLs (code is not searched)."""
    targets = []
    for line in _prose(path.read_text(encoding="utf-8")):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                targets.append(target)
    return targets


def _section(text: str, title_start: str) -> str:
    """The text of README's ``##`` section whose title starts with ``title_start``."""
    match = re.search(rf"^## {re.escape(title_start)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f'README has no "## {title_start}" section'
    return match.group(1)


# --- a user's page ---------------------------------------------------------------------------------


def test_readme_is_a_screen_and_a_bit():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES}): move depth to docs/"


def test_the_first_screen_installs_checks_and_serves_with_each_engine():
    first = "\n".join(README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN])
    assert re.search(r"^pip install -e \"\.\[vllm[^\]]*\]\"", first, re.M), "no vLLM install command"
    assert re.search(r"^pip install -e \"\.\[sglang[^\]]*\]\"", first, re.M), "no SGLang install command"
    assert re.search(r"^mla-sm120 check ", first, re.M), "no mla-sm120 check command"
    assert re.search(r"^vllm serve .*--attention-backend CUSTOM", first, re.M), "no vLLM serve command"
    assert re.search(r"^python -m sglang\.launch_server .*--mla-sm120", first, re.M), "no SGLang serve command"


def test_the_set_up_checks_are_servable():
    """README "Set up": its ``mla-sm120 check`` commands (the main job on this machine, no GPU needed)
    exit 0 as written."""
    from mla_sm120_plugin import cli

    commands = [line.split("#")[0].strip() for block in _code_blocks(_section(README.read_text(), "Set up"))
                for line in block if line.startswith("mla-sm120 check ")]
    assert len(commands) >= 2, commands  # one for each engine
    for command in commands:
        argv = shlex.split(command)[1:]
        assert cli.main(argv) == cli.EXIT_OK, command


def test_the_refusal_examples_are_what_check_prints(capsys):
    """README "Refusals you may meet": each example under a ``(`mla-sm120 check ...`...):`` lead-in is
    that command's message, line for line."""
    from mla_sm120_plugin import cli

    text = _section(README.read_text(encoding="utf-8"), "Refusals")
    examples = re.findall(r"\(`(mla-sm120 check [^`]+)`[^\n]*:\n\n```\n(.*?)\n```", text, re.S)
    assert len(examples) >= 2, "the refusal examples are gone"
    for command, printed in examples:
        rc = cli.main(shlex.split(command)[1:])
        _, err = capsys.readouterr()
        assert rc == cli.EXIT_UNSERVABLE, command
        assert err.strip() == printed.strip(), command


# --- links -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", ["README.md", *(f"docs/{name}" for name in MOVED_TO)])
def test_every_relative_link_resolves(page):
    """A link to a file names one that exists; a ``#anchor`` into a markdown file names one of its
    headings (GitHub's anchors)."""
    path = ROOT / page
    assert path.is_file(), page
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.name}")
    assert not broken, broken


def test_readme_links_each_docs_page():
    linked = {(README.parent / target.partition("#")[0]).resolve()
              for target in relative_links(README) if target.partition("#")[0]}
    pages = sorted(DOCS.glob("*.md"))
    assert {DOCS / name for name in MOVED_TO} <= set(pages)
    missing = [page.name for page in pages if page.resolve() not in linked]
    assert not missing, f"README.md does not link docs/{missing}"


def test_the_sections_tests_cite_exist():
    """A test's docstring that cites a README section by its quoted title names one README still has
    (a moved section's citations name the docs page it moved to)."""
    titles = [m.group(2) for line in _prose(README.read_text(encoding="utf-8"))
              if (m := _HEADING.match(line))]
    cited = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for section in _CITED_SECTION.findall(path.read_text(encoding="utf-8")):
            cited.setdefault(section, str(path.relative_to(ROOT)))
    assert cited, "no citations found: the pattern is stale"
    stale = {section: where for section, where in cited.items()
             if not any(title.startswith(section) for title in titles)}
    assert not stale, stale


def test_github_anchor_rules():
    assert github_anchor("Use with vLLM") == "use-with-vllm"
    assert github_anchor("NVFP4 KV cache (`nvfp4_ds_mla`): 1.86x the tokens of fp8") == \
        "nvfp4-kv-cache-nvfp4_ds_mla-186x-the-tokens-of-fp8"
    assert github_anchor("What the plugin adds over the engines' own SM120 paths") == \
        "what-the-plugin-adds-over-the-engines-own-sm120-paths"
