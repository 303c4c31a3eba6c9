"""The docs hold to the tree, as docs/cli.md holds to `--help`: every file path they name exists,
and docs/layout.md names every module."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.servers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Where a path in the docs may be relative to: the repository, the package, the stream core.
ROOTS = [REPO, REPO / "python", REPO / "python" / "mlxgate", REPO / "rust", REPO / "docs"]
SUFFIXES = (".py", ".rs", ".md", ".toml", ".sh", ".cpp", ".pyi", ".lark", ".json", ".jsonl")
# A path in backticks or a Markdown link: letters, digits, _ . - / and nothing that marks a
# placeholder or a pattern.
CANDIDATE = re.compile(r"`([\w./-]+)`|\]\(([\w./-]+)(?:#[\w-]*)?\)")


def _named_paths(text: str) -> set[str]:
    found = set()
    for quoted, linked in CANDIDATE.findall(text):
        path = quoted or linked
        if path.startswith(("http", "/", "~", ".venv", ".tools", "-")) or ".." in path:
            continue
        # A bare file name (`config.json`, `routes.py`) names a kind of file, not a path.
        if "/" in path.rstrip("/") and (path.endswith(SUFFIXES) or path.endswith("/")):
            found.add(path)
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    missing = []
    for path in sorted(_named_paths(doc.read_text())):
        if not any((root / path).exists() for root in ROOTS):
            missing.append(path)
    assert not missing, f"{doc.relative_to(REPO)} names paths the tree does not have: {missing}"


def test_the_layout_names_every_module() -> None:
    """Each Python module of the package and each Rust file of the stream core is named in
    docs/layout.md: by its path, or by its file name where the layout also names its folder
    (a folder's files are often listed together under it)."""
    layout = (REPO / "docs" / "layout.md").read_text()
    package = REPO / "python" / "mlxgate"
    modules = [
        *(p.relative_to(package) for p in package.rglob("*.py")),
        *(Path("rust") / p.relative_to(REPO / "rust") for p in (REPO / "rust").rglob("*.rs")),
    ]
    unnamed = []
    for module in modules:
        if module.name in ("__init__.py", "lib.rs", "mod.rs"):
            continue
        folder = f"{module.parent.as_posix()}/" if module.parent != Path(".") else ""
        named = module.as_posix() in layout or (
            re.search(rf"\b{re.escape(module.name)}\b", layout) and folder in layout
        )
        if not named:
            unnamed.append(module.as_posix())
    assert not unnamed, f"docs/layout.md does not name: {unnamed}"
