"""No import cycle inside memsnap/, and no hand-written module grows past about 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "memsnap"
GENERATED = ("memsnap.v1.", "memsnap.criurpc.")
MAX_LINES = 600
# Longer modules, each with the reason it is still one module.
LONG_OK = {
    "memsnap.engine": "checkpoint, restore, evict and recovery share the per-checkpoint locks and the "
                      "journal order; split next along those lines (restore.py), not before the move "
                      "package and the typed CRIU seam have settled",
}


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    """module -> memsnap modules it imports (anywhere in the file, function bodies included)."""
    mods = {_module(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                       for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:  # (never imported at run time)
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in mods and t != name)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, or [] (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            # A package imports its own submodules to re-export them: not a cycle through the package.
            if n.startswith(d + "."):
                continue
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return []

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


def test_memsnap_has_no_import_cycle() -> None:
    assert _cycle(_graph()) == []


def test_import_graph_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_hand_written_module_over_600_lines() -> None:
    long = {_module(p): n for p in PKG.rglob("*.py")
            if not _module(p).startswith(GENERATED) and _module(p) not in LONG_OK
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
