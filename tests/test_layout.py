"""The package's layering, read from the source: what a layer may not import."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "mlxgate"


def imported(path: Path) -> list[tuple[int, str]]:
    """Every module name an `import` or `from ... import` anywhere in `path` names (inside
    functions and under TYPE_CHECKING too), with its line; `from a import b` names both `a`
    and `a.b`."""
    names: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append((node.lineno, node.module))
            names += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return names


def test_models_import_nothing_above_them() -> None:
    """models/ loads models and makes them fast: it never imports the API, the app, the
    engine, the serving code, the registry or the chat rendering."""
    above = ("api", "app", "engine", "serving", "registry", "chat")
    forbidden = tuple(f"mlxgate.{name}" for name in above)
    files = sorted((PACKAGE / "models").rglob("*.py"))
    assert files
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {name}"
        for path in files
        for line, name in imported(path)
        if any(name == f or name.startswith(f"{f}.") for f in forbidden)
    ]
    assert found == []
