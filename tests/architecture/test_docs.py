"""The project's documents stand on their own: every link and path they name exists in the repository,
and none points outside it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A markdown link's target, or a repository path in backticks such as `scripts/soak.py`.
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PATH = re.compile(r"`((?:docs|scripts|shared|volunteer|backbone|protocols|tests|deploy)/[\w./-]*[\w/])`")


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_documents_never_point_outside_the_repository(document: Path) -> None:
    text = document.read_text()
    assert "../shared" not in text
    assert not re.search(r"\bseeds/", text), "the papers are cited from docs/references.md"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_link_and_named_path_exists(document: Path) -> None:
    text = document.read_text()
    missing = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (document.parent / target).exists():
            missing.append(target)
    for path in PATH.findall(text):
        if "…" in path or "*" in path:
            continue
        if not (ROOT / path).exists() and not (ROOT / (path + ".py")).exists():
            missing.append(path)
    assert not missing, f"{document.name} names what the repository does not have: {missing}"


def test_docstring_citations_resolve() -> None:
    """Docstrings cite papers as "seed 00N" and decisions as "DESIGN D4": both are defined in docs/."""
    references = (ROOT / "docs" / "references.md").read_text()
    design = (ROOT / "docs" / "design.md").read_text()
    cited_seeds: set[str] = set()
    cited_decisions: set[str] = set()
    for package in ("protocols", "shared", "volunteer", "backbone"):
        for source in (ROOT / package).rglob("*.py"):
            text = source.read_text()
            cited_seeds.update(re.findall(r"seed (\d{3})", text))
            cited_decisions.update(re.findall(r"\bD(10|[1-9])\b", text))
    assert cited_seeds, "the pattern finds the citations"
    for seed in cited_seeds:
        assert f"**seed {seed}**" in references, f"seed {seed} is cited but not in docs/references.md"
    for decision in cited_decisions:
        assert f"**D{decision} —" in design, f"D{decision} is cited but not in docs/design.md"
