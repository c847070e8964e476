"""The layering rules of DESIGN.md, checked on the source: arrows point down only.

Every import statement of kvtier's own modules and of the connectors is read with ``ast``
(module-level and function-level imports alike, ``TYPE_CHECKING`` blocks included), so a late
import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kvtier": ROOT / "kvtier", "kvtier_hf": ROOT / "connectors" / "kvtier_hf",
            "kvtier_vllm": ROOT / "connectors" / "kvtier_vllm",
            "kvtier_sglang": ROOT / "connectors" / "kvtier_sglang"}


def _modules() -> dict[str, Path]:
    out = {}
    for top, base in PACKAGES.items():
        for path in base.rglob("*.py"):
            parts = [top, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports (``from pkg import mod`` resolves to the module)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_nothing_outside_the_server_imports_it() -> None:
    offenders = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() for t in ts
                       if t.startswith("kvtier.server") and not m.startswith("kvtier.server"))
    assert offenders == []


def test_the_core_imports_no_connector() -> None:
    offenders = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith("kvtier")
                       and not m.startswith("kvtier_") for t in ts if t.startswith("kvtier_"))
    assert offenders == []


def test_protocol_imports_neither_server_nor_tiers() -> None:
    offenders = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith("kvtier.protocol")
                       for t in ts if t.startswith(("kvtier.server", "kvtier.tiers")))
    assert offenders == []


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing a package
    whose ``__init__`` imports it back is allowed (the package re-exports its modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def edges(m: str) -> list[str]:
        # A package's __init__ re-exporting its own submodules is not a dependency cycle.
        return [t for t in GRAPH[m] if not (m.startswith(t + ".") and MODULES[t].name == "__init__.py")]

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(GRAPH):
        if m not in index:
            visit(m)
    return out


def test_no_import_cycles() -> None:
    assert _cycles() == []


def test_the_checker_sees_module_and_late_imports() -> None:
    """Control: the graph is real (a known edge is found, including a function-level one)."""
    assert "kvtier.tiers.remote.data_path" in GRAPH["kvtier.tiers.remote.node"]
    assert "kvtier.tiers.remote.errors" in GRAPH["kvtier.tiers.remote.data_path"]
    assert "kvtier.tiers.disk" in GRAPH["kvtier.tiers.factory"]  # imported inside a function
