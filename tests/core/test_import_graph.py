"""The house's shape, read from the source: drafter's top-level units (a subpackage such as
drafter/capture is one unit, a top-level module such as drafter/formats.py another) import each
other without a circle; the stage packages stand side by side (none imports another: what two of
them share is in drafter/contracts); nothing below them imports one (no upward arrow); and only
the orchestration layer (drafter/stages, drafter/cli) sits above them.

Every `import` statement counts: at module level, inside functions (lazy imports) and under
`if TYPE_CHECKING:` (a type-only circle is still a circle for a reader). Units are found on the
file system, so a module that moves needs no edit here.

Run `pytest -s tests/core/test_import_graph.py` to print the figures (units, edges, floors).
"""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "drafter"
PACKAGE = "drafter"

# Stages that exchange work through the store: none imports another (what they share is in
# drafter/contracts).
STAGE_PACKAGES = ("prepare", "datagen", "capture", "training", "export", "bench", "retrain")
# Wiring of the stages (the stage table, the smoke run over it, the CLI): may import anything,
# nothing below imports it.
ORCHESTRATION = ("stages", "smoke", "cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit_of(module: str) -> str | None:
    """drafter.contracts.shards -> contracts; drafter.formats -> formats; drafter -> None."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        return None
    return parts[1]


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every drafter module (or name in one) imported anywhere in the tree, absolute."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.add(source)
            # `from drafter import capture` may name a module: kept whole, cut back to its module later.
            found.update(f"{source}.{a.name}" for a in node.names)
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


@lru_cache(maxsize=1)
def module_graph() -> dict[str, set[str]]:
    """drafter module -> the drafter modules it imports (names inside modules are cut to the module)."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = set()
        for imp in _imported(tree, name, path.name == "__init__.py"):
            while imp not in files and "." in imp:  # `from drafter.x import Name`: the module is drafter.x
                imp = imp.rsplit(".", 1)[0]
            if imp in files and imp != name:
                targets.add(imp)
        graph[name] = targets
    return graph


@lru_cache(maxsize=1)
def unit_graph() -> dict[str, dict[str, list[tuple[str, str]]]]:
    """unit -> {imported unit: [(importing module, imported module), ...]}."""
    units: dict[str, dict[str, list[tuple[str, str]]]] = {}
    for src, targets in module_graph().items():
        su = _unit_of(src)
        if su is None:
            continue
        edges = units.setdefault(su, {})
        for dst in sorted(targets):
            du = _unit_of(dst)
            if du is not None and du != su:
                edges.setdefault(du, []).append((src, dst))
    return units


def find_cycle(graph: dict[str, object]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first, deterministic order)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _components(graph: dict[str, object]) -> dict[str, str]:
    """node -> the name of its strongly connected component: itself, or '{a|b|...}' for a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    names: dict[str, str] = {}

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            name = members[0] if len(members) == 1 else "{" + "|".join(sorted(members)) + "}"
            names.update((m, name) for m in members)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return names


def floors(graph: dict[str, object]) -> tuple[int, list[str]]:
    """The longest import chain (number of units or modules on it) and the chain itself, top first.
    A circle counts as one floor (named '{a|b|...}')."""
    comp = _components(graph)
    below: dict[str, set[str]] = {c: set() for c in comp.values()}
    for node, targets in graph.items():
        below[comp[node]].update(comp[t] for t in targets if t in comp and comp[t] != comp[node])
    memo: dict[str, list[str]] = {}

    def chain(c: str) -> list[str]:
        if c not in memo:
            memo[c] = [c] + max((chain(n) for n in sorted(below[c])), key=len, default=[])
        return memo[c]

    best = max((chain(c) for c in sorted(below)), key=len, default=[])
    return len(best), best


def figures() -> str:
    units = unit_graph()
    modules = module_graph()
    n_unit, unit_chain = floors(units)
    n_mod, mod_chain = floors(modules)
    edges = sum(len(v) for v in units.values())
    return (f"{len(units)} units, {edges} unit edges, {n_unit} unit floors ({' -> '.join(unit_chain)}); "
            f"{len(modules)} modules, {n_mod} module floors ({' -> '.join(mod_chain)})")


def _describe(edges: dict[str, dict[str, list[tuple[str, str]]]], pairs) -> str:
    lines = []
    for su, du in pairs:
        via = ", ".join(f"{a} -> {b}" for a, b in edges[su][du][:3])
        lines.append(f"  {su} -> {du} (via {via})")
    return "\n".join(lines)


def test_no_import_cycle_between_units():
    units = unit_graph()
    cycle = find_cycle(units)
    if cycle:
        pairs = list(zip(cycle, cycle[1:]))
        raise AssertionError(f"import circle between units {' -> '.join(cycle)}:\n{_describe(units, pairs)}\n"
                             f"{figures()}")


def test_stage_packages_stand_side_by_side():
    units = unit_graph()
    present = [s for s in STAGE_PACKAGES if s in units]
    assert present, f"no stage package found under {ROOT}"
    pairs = [(s, d) for s in present for d in sorted(units[s]) if d in STAGE_PACKAGES]
    assert not pairs, ("a stage package imports another (what two stages share belongs in drafter/contracts):\n"
                       f"{_describe(units, pairs)}\n{figures()}")


def test_nothing_below_imports_a_stage_package():
    """No upward arrow: contracts, config, store, serving, engines and the core modules import no stage."""
    units = unit_graph()
    pairs = [(s, d) for s in sorted(units) if s not in STAGE_PACKAGES + ORCHESTRATION for d in sorted(units[s])
             if d in STAGE_PACKAGES]
    assert not pairs, f"a unit below the stage packages imports one:\n{_describe(units, pairs)}\n{figures()}"


def test_nothing_below_imports_the_orchestration_layer():
    units = unit_graph()
    pairs = [(s, d) for s in sorted(units) if s not in ORCHESTRATION for d in sorted(units[s])
             if d in ORCHESTRATION]
    assert not pairs, f"a unit below the orchestration layer imports it:\n{_describe(units, pairs)}\n{figures()}"


def test_the_graph_is_read():
    """The reader sees lazy and type-only imports (what the rules above rely on), and prints the figures."""
    tree = ast.parse("def f():\n    from drafter.a import b\nif TYPE_CHECKING:\n    import drafter.c\n"
                     "from . import d\nfrom .e import g\n")
    assert _imported(tree, "drafter.x.y", False) == {"drafter.a", "drafter.a.b", "drafter.c", "drafter.x",
                                                     "drafter.x.d", "drafter.x.e", "drafter.x.e.g"}
    assert _imported(tree, "drafter.x", True) == _imported(tree, "drafter.x.y", False)
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert floors({"a": {"b"}, "b": {"c"}, "c": set()}) == (3, ["a", "b", "c"])
    assert floors({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == (2, ["a", "{b|c}"])
    print(figures())
