"""README and docs/: every relative link resolves, README stays short, its demo sample is true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 250

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`[^`]*`")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a ``# comment`` in a bash block is no heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose_lines(path.read_text()):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """Relative link targets of ``path``'s prose (code blocks and code spans are not links)."""
    out = []
    for line in _prose_lines(path.read_text()):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                out.append(target)
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each link of ``path`` whose file (inside ``root``) or heading does not exist."""
    broken = []
    for target in links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists() or root not in (resolved, *resolved.parents):
            broken.append(f"{target} (no such file)")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{target} (no heading #{anchor})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section: `with code`\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [ok](other.md#a-section-with-code) [ok](#here)\n"
                    "# Here\n"
                    "[gone](missing.md) [bad anchor](other.md#nowhere) [self](#nowhere-else)\n"
                    "`[not a link](missing.md)`\n"
                    "```\n[in code](missing.md)\n# not a heading\n```\n"
                    "[web](https://example.com/x)\n")
    assert broken_links(page, root=tmp_path) == ["missing.md (no such file)",
                                                 "other.md#nowhere (no heading #nowhere)",
                                                 "#nowhere-else (no heading #nowhere-else)"]
    assert "not-a-heading" not in anchors(page)


def test_slug_follows_github() -> None:
    assert slug("Choosing the source: `DYN_KVBM_KV_EVENTS_SOURCE`") \
        == "choosing-the-source-dyn_kvbm_kv_events_source"
    assert slug("One block, from TensorRT-LLM's event to the router") \
        == "one-block-from-tensorrt-llms-event-to-the-router"


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def test_docs_pages_exist_and_readme_links_each() -> None:
    targets = {t.partition("#")[0] for t in links(README)}
    for name in ("architecture", "operations", "event_sources", "performance", "development"):
        assert (ROOT / "docs" / f"{name}.md").exists()
        assert f"docs/{name}.md" in targets


# Lines of the demo's summary whose counts depend on thread timing (iterations, batches, and so
# what dedup suppresses; whether a block's offload finished before the next turn asked for it,
# and so which tier served it or whether it was computed): compared with their numbers masked.
_TIMING_DEPENDENT = ("requests", "prefill tokens", "hit rate", "GPU-tier events",
                     "consolidated events", "suppressed by dedup", "subscriber view",
                     "router view")


def _masked(line: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", line)


def _without_join_note(line: str) -> str:
    """Whether the demo's subscriber joined before the first batch is thread timing: the note
    it adds then (how many batches it took from the replay) is not compared."""
    return re.sub(r" \(joined late: .*\)$", "", line)


def _readme_demo_sample() -> list[str]:
    text = README.read_text()
    after = text[text.index("`kvbm-plugin demo` prints"):]
    block = after[after.index("```text\n") + len("```text\n"):]
    return [line for line in block[:block.index("```")].splitlines() if line.strip()]


def test_readme_demo_sample_is_what_the_demo_prints(capsys) -> None:
    from kvbm_plugin.cli import demo

    assert demo.main_demo(["--no-progress"]) == 0
    out = [_without_join_note(line) for line in capsys.readouterr().out.splitlines()]
    sample = _readme_demo_sample()
    assert len(sample) >= 10
    for line in sample:
        if line.strip().startswith(_TIMING_DEPENDENT):
            assert _masked(line) in {_masked(x) for x in out}, line
        else:
            assert line in out, line
    # The prose under the sample quotes the hit rates: the same figures, rounded, within one
    # point (a block offloaded a little late moves 32 of ~15,000 tokens between tiers).
    numbers = {}
    for line in out:
        match = re.match(r"\s+(prefill tokens|hit rate \w+)\s+(.*)", line)
        if match:
            numbers[match.group(1)] = [float(x) for x in re.findall(r"\d+(?:\.\d+)?",
                                                                    match.group(2))]
    prompts, _, reused = numbers["prefill tokens"]
    gpu, host, disk = (numbers[f"hit rate {t}"][0] for t in ("GPU", "host", "disk"))
    prose = " ".join(README.read_text().split())
    quoted = re.search(r"(\d+) % of prompt tokens are reused: (\d+) % from the GPU pool, "
                       r"(\d+) % onboarded from host and disk", prose)
    assert quoted, "README's prose no longer quotes the demo's hit rates"
    for said, measured in zip((int(x) for x in quoted.groups()),
                              (100 * reused / prompts, gpu, host + disk), strict=True):
        assert abs(said - measured) <= 1, (said, measured)
