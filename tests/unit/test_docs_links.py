"""The project's own docs stay inside the repository: every relative link resolves.

README.md and docs/**/*.md may link web pages (``https://...``) and anchors; every other
link must name a file or folder of this repository. ``docs/<page>.md`` cited in the code,
the tests and the scripts must exist too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# [text](target "title"), ![alt](target) and reference definitions "[id]: target"
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.M)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_CITED = re.compile(r"\bdocs/[A-Za-z0-9_./-]+\.md\b")


def relative_links(page: Path) -> list[str]:
    """The link targets of ``page`` that are neither URLs nor same-page anchors."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    out = []
    for m in _LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if _SCHEME.match(target) or target.startswith("#"):
            continue
        out.append(target)
    return out


def test_pages_found() -> None:
    assert (ROOT / "README.md").is_file()
    assert len(PAGES) > 5, PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_repo(page: Path) -> None:
    bad = []
    for target in relative_links(page):
        path = target.split("#", 1)[0]
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(ROOT):
            bad.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            bad.append(f"{target} (no such file)")
    assert not bad, f"{page.relative_to(ROOT)}: broken links: {bad}"


def test_relative_link_parser(tmp_path: Path) -> None:
    page = tmp_path / "probe.md"
    page.write_text('[a](api.md) [b](https://x.org/y.md) [c](#top) ![d](img/p.png "t")\n'
                    "```\n[e](not-a-link.md)\n```\n[f]: ../README.md\n", encoding="utf-8")
    assert relative_links(page) == ["api.md", "img/p.png", "../README.md"]


def test_cited_docs_pages_exist() -> None:
    sources = [p for d in ("lmcache_kv_fast", "csrc", "tests", "scripts", "examples", "benches")
               for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh", ".md", ".cpp", ".h")]
    sources += [ROOT / "README.md", *PAGES]
    missing = sorted({f"{p.relative_to(ROOT)}: {m}" for p in sources if p.is_file()
                      for m in _CITED.findall(p.read_text(encoding="utf-8", errors="replace"))
                      if not (ROOT / m).is_file()})
    assert not missing, missing
