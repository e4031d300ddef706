"""The project documents itself: the design as built lives in the repository
(``docs/architecture.md``), the README links to it, nothing points outside the repository,
and every "docs/architecture.md §N" citation in the code names a section that exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARCH = REPO / "docs" / "architecture.md"
TEXT_SUFFIXES = {".py", ".md", ".proto", ".toml", ".txt", ".cfg", ".ini", ".sh", ""}
# Paths of the development workspace around the checkout; a clone has none of them.
OUTSIDE = re.compile(r"\.\./shared|shared/DESIGN|shared/STYLE|DESIGN\.md|STYLE\.md")
CITATION = re.compile(r"docs/architecture\.md §(\d+)")


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    files = [REPO / p for p in out if (REPO / p).is_file()]
    return [p for p in files if p.suffix in TEXT_SUFFIXES and p.name != "requirements.lock"]


def sections() -> set[int]:
    return {int(m) for m in re.findall(r"^## (\d+)\. ", ARCH.read_text(), flags=re.M)}


def test_architecture_doc_exists_and_the_readme_links_to_it() -> None:
    assert ARCH.is_file(), "docs/architecture.md is the design as built; it must be in the repository"
    assert "docs/architecture.md" in (REPO / "README.md").read_text()
    assert {2, 3, 4, 5, 6, 10}.issubset(sections()), sorted(sections())


def test_nothing_in_the_repository_refers_to_paths_outside_it() -> None:
    this = Path(__file__).resolve()
    hits = []
    for path in tracked_text_files():
        if path.resolve() == this:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)


def test_every_architecture_citation_names_an_existing_section() -> None:
    known = sections()
    bad = []
    for path in tracked_text_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            bad += [f"{path.relative_to(REPO)}:{n}: §{m}" for m in CITATION.findall(line) if int(m) not in known]
    assert not bad, f"citations of missing sections (the doc has {sorted(known)}):\n" + "\n".join(bad)
