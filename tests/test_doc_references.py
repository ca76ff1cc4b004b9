"""Every reference in the source, the tests and the docs resolves inside the repository.

- A relative Markdown link in ``README.md`` or ``docs/*.md`` names a file that exists.
- Source, tests, scripts and docs cite ``docs/<name>.md`` (never a design or protocol
  document outside the repository), and a cited section (``docs/design.md §5.2``) is a
  numbered heading or a numbered rule of that document.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
CODE = [
    *sorted((ROOT / "src").rglob("*.py")),
    *sorted((ROOT / "tests").rglob("*.py")),
    *sorted((ROOT / "scripts").rglob("*")),
]
CITED = re.compile(r"docs/([a-z0-9_-]+\.md)(?:,? (?:§|section |sections )([0-9][0-9.]*))?")
OUTSIDE = re.compile(r"(?<![\w/])(DESIGN|PROTOCOL)\.md")


def _texts(paths: list[Path]) -> list[tuple[Path, str]]:
    return [(p, p.read_text(encoding="utf-8", errors="replace")) for p in paths if p.is_file()]


def _sections(doc: Path) -> set[str]:
    """Numbers of headings (``## 5. Flows``, ``### 5.2 Symmetric``) and of numbered
    rules under a numbered heading (``3.`` under ``## 3.`` is 3.3)."""
    found: set[str] = set()
    current = ""
    for line in doc.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"#+\s+(?:§\s*)?([0-9]+(?:\.[0-9]+)*)\.?\s", line)
        if heading:
            current = heading.group(1)
            found.add(current)
            continue
        rule = re.match(r"([0-9]+)\.\s", line)
        if rule and current and "." not in current:
            found.add(f"{current}.{rule.group(1)}")
    return found


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_name_files_that_exist(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_no_citation_leaves_the_repository() -> None:
    outside = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path, text in _texts([*CODE, ROOT / "README.md", *DOCS])
        for match in OUTSIDE.finditer(text)
    ]
    assert outside == []


def test_cited_documents_and_sections_exist() -> None:
    sections = {doc.name: _sections(doc) for doc in DOCS}
    problems = []
    for path, text in _texts([*CODE, ROOT / "README.md", *DOCS]):
        for match in CITED.finditer(text):
            name, number = match.group(1), match.group(2)
            if name not in sections:
                problems.append(f"{path.relative_to(ROOT)}: no docs/{name}")
            elif number and number.rstrip(".") not in sections[name]:
                problems.append(f"{path.relative_to(ROOT)}: docs/{name} has no §{number}")
    assert problems == []
