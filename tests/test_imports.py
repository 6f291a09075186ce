"""The product's imports form no circle: every `pipeline.*` import of every module under pipeline/ (at the top or
inside a function) read with `ast`, and the module graph searched for a cycle; the layers that `lint-imports` checks
(pyproject.toml) are the ones docs/ARCHITECTURE.md states."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(file: Path) -> str:
    parts = file.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(file: Path, name: str, modules: set[str]) -> set[str]:
    """The `pipeline.*` modules that the module `name` (in `file`) imports anywhere in its code: for
    `from package import name`, the submodule where `name` is one, else the package."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    """Module -> the `pipeline.*` modules it imports, for every module under pipeline/."""
    files = {_module_name(f): f for f in sorted((ROOT / "pipeline").rglob("*.py"))}
    return {name: _imports(file, name, set(files)) for name, file in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "pipeline.rl.onpolicy" in graph["pipeline.stages.dpo"]  # imported inside `_on_policy`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_layers_docs_architecture_states_are_the_contract_ci_checks():
    """docs/ARCHITECTURE.md's layer line is pyproject.toml's import-linter contract, which ignores no import: none
    points up a layer."""
    import tomllib

    (contract,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    text = (ROOT / "docs/ARCHITECTURE.md").read_text().split("## Which way imports go", 1)[1]
    stated = " ".join(text.split("\n\n")[2].split()).split(" -> ")
    assert stated == [layer.replace("pipeline.", "") for layer in contract["layers"]]
    assert "ignore_imports" not in contract
