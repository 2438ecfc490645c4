"""The documentation holds together: README.md (the front page), the manual in docs/ (a site through mkdocs.yml) and
benchmarks/README.md. Every relative link and image resolves, anchors name a heading of their page, every ``python``
block parses, the site builds with ``mkdocs build --strict``, its nav lists every page of docs/, and the README stays
a front page."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 260

FENCE = re.compile(r"^(```|~~~)[^\n]*\n.*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
#: ``[text](target)`` and ``![alt](target)``, with an optional title; the text may hold one level of brackets.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), ROOT / "benchmarks" / "README.md"]


def _ids(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans (a link inside code is not a link)."""
    return CODE_SPAN.sub("code", FENCE.sub("", text))


def _links(text: str) -> list[str]:
    return LINK.findall(_prose(text))


def _slugs(heading: str) -> set[str]:
    """The ids GitHub and mkdocs (Python-Markdown's toc) give a heading: lowercase, punctuation but hyphens dropped,
    spaces to hyphens (GitHub: each space; toc: runs of spaces and hyphens collapse)."""
    text = re.sub(r"<[^>]+>", "", heading).replace("`", "").strip().lower()
    github = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    toc = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip())
    return {github, toc}


def _anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", FENCE.sub("", path.read_text()), re.MULTILINE)
    return set().union(*(_slugs(h) for h in headings)) if headings else set()


def _broken_links(path: Path, docs: Path = DOCS) -> list[str]:
    broken = []
    for target in _links(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http(s)://, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: {resolved} does not exist")
            continue
        if path.is_relative_to(docs) and not resolved.is_relative_to(docs):
            broken.append(f"{target}: leaves docs/ (mkdocs cannot link it; write the path in backticks)")
        if anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading of {_ids(resolved)} has the id {anchor!r}")
    return broken


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    return []


def _mkdocs_config() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


@pytest.mark.parametrize("path", _pages(), ids=_ids)
def test_relative_links_and_images_resolve(path: Path):
    assert path.exists(), f"{_ids(path)} is missing"
    assert not _broken_links(path), "\n".join(_broken_links(path))


@pytest.mark.parametrize("path", _pages(), ids=_ids)
def test_python_blocks_parse(path: Path):
    bad = []
    for number, block in enumerate(PYTHON_BLOCK.findall(path.read_text()), 1):
        try:
            ast.parse(block)
        except SyntaxError as error:
            bad.append(f"block {number}, line {error.lineno}: {error.msg}\n{block}")
    assert not bad, "\n".join(bad)


def test_nav_lists_every_page_of_docs():
    config = _mkdocs_config()
    assert config.get("docs_dir", "docs") == "docs"
    listed = _nav_pages(config.get("nav"))
    assert listed, "mkdocs.yml has no nav"
    missing = [page for page in listed if not (DOCS / page).is_file()]
    assert not missing, f"pages in mkdocs.yml's nav that docs/ does not hold: {missing}"
    unlisted = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if str(p.relative_to(DOCS)) not in listed)
    assert not unlisted, f"pages of docs/ that mkdocs.yml's nav does not list: {unlisted}"
    assert len(listed) == len(set(listed)), "a page is listed twice in mkdocs.yml's nav"


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move the detail to docs/"


def test_mkdocs_build_strict(tmp_path: Path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "index.html").is_file()


def test_the_checks_catch_what_they_should(tmp_path: Path):
    """The helpers above find a missing file, a missing anchor, a missing image and a link out of docs/, accept an
    anchor of another page, ignore links inside code, and see a block that does not parse."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "outside.md").write_text("# Outside\n")
    (docs / "other.md").write_text("# Other page\n\n## Evaluation, prediction and `generate` in 2-D\n")
    page = docs / "page.md"
    page.write_text(
        "# A title: with `code`\n\n[ok](#a-title-with-code) [gone](nowhere.md) [bad](#no-such-heading)\n"
        "[there](other.md#evaluation-prediction-and-generate-in-2-d) [not there](other.md#outside)\n"
        "[out](../outside.md) `[in code](nowhere.md)`\n\n```bash\n[in a block](nowhere.md)\n```\n\n"
        "![img](missing.png)\n"
    )
    broken = _broken_links(page, docs=docs)
    expected = ["nowhere.md", "#no-such-heading", "other.md#outside", "../outside.md", "missing.png"]
    assert len(broken) == len(expected), broken
    for target in expected:
        assert any(b.startswith(target) for b in broken), (target, broken)
    assert _slugs("Derived plans (models without `base_model_tp_plan`)") == {
        "derived-plans-models-without-base_model_tp_plan"
    }
    with pytest.raises(SyntaxError):
        ast.parse(PYTHON_BLOCK.findall("```python\nif x\n```\n")[0])
