"""`pipeline/runfolder.py` is the only module that knows a path inside the run folder.

The rule: every file and folder the pipeline lays out in a run folder (`stages/`, `NN-name/`, `stage.json`,
`model/`, `work/`, `eval/`, `samples_<task>.jsonl`, `candidates/`, `pipeline.log`, `manifest.json`,
`outcome.json`, the leaderboard files, a DPO stage's pairs, PPO's value model, ...) is named in runfolder.py
only; every other product module (`pipeline/**/*.py`) gets such a path from runfolder's functions and
properties. A module builds a path inside the run folder when, in a path position (the right of `/`, a part
passed to `Path(...)`, `os.path.join`, `.joinpath`, `.glob` / `.rglob` / `.with_name`, the file of `open`, the
name of a `RunLock`), it puts

(a) a name that runfolder.py itself puts in a path position (a string literal, an f-string as a pattern such as
    `samples_*.jsonl`, or a constant or local bound to one), whatever it is joined to; or
(b) any string literal or f-string joined onto a path known to lie in the run folder: what a runfolder
    function returns (`RUN_FUNCTIONS`), the folders the chain hands around (`RUN_ATTRIBUTES`: a
    `StageContext`'s `stage_dir` / `out_dir`, a `StageDecision`'s `dir`, a `Run`'s `root` / `paths`), and the
    local names and loop variables bound to those in the same function.

Not in scope: what lies inside a folder that a format or library owns (a checkpoint's `model/`: its
`config.json`, weights and `README.md` card; the trainer's `checkpoint-N` and the actor-critic's `update-N/` in
`work/`), and paths outside the run folder (the cache, the repository's recipes and task templates, the temp
folder). Where a name of (a) is used outside the run folder, that one expression is listed in `OUTSIDE` with
where it points.
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNFOLDER = "pipeline/runfolder.py"
# runfolder functions whose value is a place in the run folder that runfolder lays out (not model/, work/, logs/:
# their contents are the checkpoint's, the trainer's, TensorBoard's)
RUN_FUNCTIONS = {"run_dir", "stage_dir", "base_dir", "candidate_dir", "candidate_folders", "stage_folders",
                 "samples_dir", "eval_dir", "run_root", "input_stage", "RunPaths"}
RUN_ATTRIBUTES = {"stage_dir", "out_dir", "dir", "root", "paths"}
PATH_CALLS = {"Path", "PurePath", "PosixPath"}  # Path(base, part, ...)
PATH_METHODS = {"joinpath", "glob", "rglob", "with_name"}  # base.method(part, ...)
# (module, expression): a run-folder name used for a place outside the run folder
OUTSIDE = {
    ("pipeline/chain/preflight.py", "Path(tempfile.gettempdir()) / 'trl-args-check' / 'work'"):
        "a scratch folder in the temp folder for a trainer-arguments check",
    ("pipeline/tiny/model.py", "root / 'model'"): "the tiny base model's folder in the cache",
    ("pipeline/tiny/model.py", "build / 'pretrain' / 'model'"): "the tiny base model's build folder in the cache",
    ("pipeline/tiny/__init__.py", "data.tiny_dir(cache_dir(cfg), _settings(cfg), cfg.model, cfg.seed) / 'model'"):
        "the tiny base model's folder in the cache",
}


@dataclass
class Module:
    """One parsed module: its assignments per function (flow-insensitive), to resolve a name to what it holds."""

    path: str
    tree: ast.Module
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)
    bound: dict[ast.AST, dict[str, list[tuple[str, ast.expr]]]] = field(default_factory=dict)  # scope -> name ->
    # [("value", expr) | ("item", iterable)]
    runfolder_names: set[str] = field(default_factory=set)  # names this module imports from pipeline.runfolder

    @classmethod
    def parse(cls, path: str, source: str) -> Module:
        """Parse `source` and index its scopes."""
        m = cls(path, ast.parse(source))
        for node in ast.walk(m.tree):
            for child in ast.iter_child_nodes(node):
                m.parents[child] = node
            if isinstance(node, ast.ImportFrom) and node.module == "pipeline.runfolder":
                m.runfolder_names |= {a.asname or a.name for a in node.names}
        for node in ast.walk(m.tree):
            m._bind(node)
        return m

    def scope(self, node: ast.AST) -> ast.AST:
        """The innermost function (or the module) that holds `node`."""
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return node
        return self.tree

    def _add(self, at: ast.AST, target: ast.expr, kind: str, value: ast.expr) -> None:
        if isinstance(target, ast.Name):
            self.bound.setdefault(self.scope(at), {}).setdefault(target.id, []).append((kind, value))
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._add(at, t, kind, v)

    def _bind(self, node: ast.AST) -> None:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._add(node, target, "value", node.value)
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            self._add(node, node.target, "value", node.value)
        elif isinstance(node, (ast.For, ast.comprehension)):
            self._add(node if isinstance(node, ast.For) else node.iter, node.target, "item", node.iter)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            self._add(node.context_expr, node.optional_vars, "value", node.context_expr)

    def lookup(self, name: ast.Name) -> list[tuple[str, ast.expr]]:
        """What `name` may hold where it is used: its bindings in the enclosing functions, else the module's."""
        node: ast.AST = name
        while True:
            scope = self.scope(node)
            found = self.bound.get(scope, {}).get(name.id)
            if found or scope is self.tree:
                return found or []
            node = scope

    def patterns(self, expr: ast.expr | None, seen: frozenset[str] = frozenset()) -> list[str]:
        """The path names `expr` may be: a literal, an f-string as a glob pattern (`samples_*.jsonl`), either
        branch of `a if c else b`, or what a name bound to one of those holds."""
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return [expr.value]
        if isinstance(expr, ast.JoinedStr):
            return ["".join(v.value if isinstance(v, ast.Constant) else "*" for v in expr.values)]
        if isinstance(expr, ast.IfExp):
            return self.patterns(expr.body, seen) + self.patterns(expr.orelse, seen)
        if isinstance(expr, ast.Name) and expr.id not in seen:
            return [p for kind, value in self.lookup(expr) if kind == "value"
                    for p in self.patterns(value, seen | {expr.id})]
        return []

    def in_run(self, expr: ast.expr | None, seen: frozenset[str] = frozenset()) -> bool:
        """Whether `expr` is a path known to lie in the run folder (rule (b) of the module docstring)."""
        if isinstance(expr, ast.Call):
            fn = expr.func
            if isinstance(fn, ast.Name) and fn.id in self.runfolder_names and fn.id in RUN_FUNCTIONS:
                return True
            if isinstance(fn, ast.Attribute) and fn.attr in RUN_FUNCTIONS and _dotted(fn.value) == "runfolder":
                return True
            if isinstance(fn, ast.Attribute) and fn.attr == "of" and self.in_run(fn.value, seen):
                return True  # RunPaths.of(cfg)
            return _call_name(fn) in PATH_CALLS and bool(expr.args) and self.in_run(expr.args[0], seen)
        if isinstance(expr, ast.Name):
            if expr.id in self.runfolder_names and expr.id in RUN_FUNCTIONS:
                return True  # the class RunPaths itself
            return expr.id not in seen and any(self.in_run(v, seen | {expr.id}) for _, v in self.lookup(expr))
        if isinstance(expr, ast.Attribute):
            return expr.attr in RUN_ATTRIBUTES or self.in_run(expr.value, seen)
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Div):
            return self.in_run(expr.left, seen)
        return False


def _dotted(expr: ast.expr) -> str:
    if isinstance(expr, ast.Attribute):
        return f"{_dotted(expr.value)}.{expr.attr}"
    return expr.id if isinstance(expr, ast.Name) else ""


def _call_name(fn: ast.expr) -> str:
    return fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""


def path_positions(tree: ast.Module) -> Iterator[tuple[ast.expr, ast.expr | None, ast.AST]]:
    """(part, the path it is joined onto or None, the expression that joins them) of every path position."""
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            yield node.right, node.left, node
        elif isinstance(node, ast.Call) and node.args:
            fn, args = node.func, node.args
            if _call_name(fn) in PATH_CALLS or _dotted(fn) == "os.path.join":
                yield args[0], None, node
                yield from ((a, args[0], node) for a in args[1:])
            elif isinstance(fn, ast.Attribute) and fn.attr in PATH_METHODS:
                yield from ((a, fn.value, node) for a in args)
            elif isinstance(fn, ast.Name) and fn.id == "open":
                yield args[0], None, node
            elif _call_name(fn) == "RunLock" and len(args) > 1:
                yield args[1], args[0], node


def vocabulary(runfolder: Module) -> set[str]:
    """The names runfolder.py puts in path positions; patterns with fewer than 3 letters or digits of their own
    (`*-*` of `NN-name`, `*`) match too much to be names."""
    names = {p for part, _, _ in path_positions(runfolder.tree) for p in runfolder.patterns(part)}
    return {n for n in names if sum(c.isalnum() for c in n) >= 3}


def violations(module: Module, names: set[str]) -> list[str]:
    """`path:line: ...` for every run-folder path `module` builds (none for runfolder.py itself)."""
    if module.path == RUNFOLDER:
        return []
    out: list[tuple[int, str]] = []
    for part, base, node in path_positions(module.tree):
        parts = module.patterns(part)
        known = sorted({n for p in parts for segment in p.split("/") for n in names
                        if fnmatch.fnmatchcase(segment, n)})
        joined = base is not None and bool(parts) and module.in_run(base)
        text = ast.unparse(node)
        if (known or joined) and (module.path, text) not in OUTSIDE:
            why = f"run-folder name {', '.join(known)}" if known else f"{', '.join(parts)} joined to a run-folder path"
            out.append((node.lineno, f"{module.path}:{node.lineno}: {why} in `{text}`: ask runfolder.py for it"))
    return [v for _, v in sorted(out)]


def _modules() -> list[Module]:
    files = sorted((ROOT / "pipeline").rglob("*.py"))
    return [Module.parse(f.relative_to(ROOT).as_posix(), f.read_text(encoding="utf-8")) for f in files]


def test_only_runfolder_builds_run_folder_paths():
    """No product module but runfolder.py builds a path inside the run folder."""
    modules = _modules()
    names = vocabulary(next(m for m in modules if m.path == RUNFOLDER))
    assert {"stages", "stage.json", "model", "eval", "samples_*.jsonl", "pipeline.log", "outcome.json"} <= names
    found = [v for m in modules for v in violations(m, names)]
    assert not found, "\n".join(found)


def test_every_outside_exception_is_still_used():
    """An `OUTSIDE` entry that matches no expression any more goes (the list stays the real exceptions)."""
    modules = {m.path: m for m in _modules()}
    used = {(path, ast.unparse(node)) for path, m in modules.items() for _, _, node in path_positions(m.tree)}
    assert set(OUTSIDE) <= used, set(OUTSIDE) - used


def test_detector_catches_new_run_folder_paths():
    """The detector on a snippet: names runfolder knows joined anywhere, and any name joined onto a run-folder
    path, are caught; a checkpoint's own files and paths outside the run folder are not."""
    names = vocabulary(Module.parse(RUNFOLDER, (ROOT / RUNFOLDER).read_text(encoding="utf-8")))
    snippet = '''
import os
from pathlib import Path
from pipeline.runfolder import RunPaths, run_dir, stage_folders

RECORD_NAME = "stage.json"

def a(folder): return folder / "stage.json"
def b(folder, task): return Path(folder, f"samples_{task}.jsonl")
def c(folder): return folder / RECORD_NAME
def d(ctx): return ctx.stage_dir / "rewards.json"
def e(cfg):
    root = run_dir(cfg)
    return root / "notes.txt"
def f(root):
    for folder in stage_folders(root):
        yield folder.joinpath("extra")
def g(cfg): return RunPaths.of(cfg).stages / "x"
def h(root): return os.path.join(root, "manifest.json")
def i(model_path): return Path(model_path) / "config.json"
def j(tmp): return tmp / "weights.pt"
def k(cache): return Path(cache) / f"tiny-{cache}"
'''
    found = violations(Module.parse("pipeline/snippet.py", snippet), names)
    lines = sorted(int(v.split(":")[1]) for v in found)
    assert lines == [8, 9, 10, 11, 14, 17, 18, 19], "\n".join(found)
