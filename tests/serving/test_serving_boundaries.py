"""Serving supervises; engines serve. Supervision (drafter/serving/) imports no torch and names no
engine; the trainer imports nothing from serving; no `engine == "<name>"` test stands outside the
engine modules (drafter/engines/): callers ask the engine (drafter.engine_registry)."""
from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import drafter.serving
from drafter.engine_registry import ENGINES

ROOT = Path(__file__).resolve().parents[2]
DRAFTER = ROOT / "drafter"
SERVING = [f"drafter.serving.{m.name}" for m in pkgutil.iter_modules(drafter.serving.__path__)]


def sources(*parts: str, root: Path = DRAFTER):
    for path in sorted(root.joinpath(*parts).rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def test_importing_serving_imports_no_torch():
    assert {"drafter.serving.launcher", "drafter.serving.session", "drafter.serving.gate"} <= set(SERVING)
    code = (f"import importlib, sys\nfor m in {SERVING!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_serving_names_no_engine():
    """No string constant in drafter/serving equal to an engine's name (docstrings aside): a branch
    on an engine belongs to that engine's class."""
    found = []
    for path, tree in sources("serving"):
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ENGINES
                  and id(node) not in docstrings]
    assert found == []


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_the_trainer_imports_nothing_from_serving():
    found = [f"{path.relative_to(ROOT)}: {name}" for path, tree in sources("training") for name in _imports(tree)
             if name == "drafter.serving" or name.startswith("drafter.serving.")]
    assert found == []


def test_no_engine_name_test_outside_the_engine_modules():
    """No `<...>engine == "<name>"` (or !=, in, not in a collection of names) outside drafter/engines
    (the library, the Prefect wrappers, the benchmarks)."""
    def names_engine(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in ENGINES if isinstance(node.value, str) else False
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_engine(e) for e in node.elts)
        return False

    def is_engine(node: ast.AST) -> bool:
        text = ast.unparse(node)
        return text == "engine" or text.endswith(".engine") or text.endswith("engine.name")

    found = []
    trees = [item for root in (DRAFTER, ROOT / "tasks", ROOT / "flows", ROOT / "benchmarks")
             for item in sources(root=root)]
    for path, tree in trees:
        if path.is_relative_to(DRAFTER / "engines"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(is_engine(s) for s in sides) and any(names_engine(s) for s in sides):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
