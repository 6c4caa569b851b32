"""The package's shape (docs/architecture.md): rooms in one import order, no import cycle, short modules.

Reads the source with ``ast`` (every import, also inside functions and ``TYPE_CHECKING`` blocks); imports nothing.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tl_steering"

#: the rooms, lowest first: a module may import its own room and the rooms on earlier lines, never a later line;
#: rooms on one line are siblings and do not import each other
ORDER: list[tuple[str, ...]] = [
    ("primitives",),
    ("reference",),
    ("backends",),
    ("data",),
    ("hooks",),
    ("probing",),
    ("protocols", "critical", "parallel"),
    ("suite",),
    ("report",),
    ("cli",),
    ("tl_steering",),  # the public surface: tl_steering/__init__.py
]
PRIMITIVES = {"errors", "validation", "_util", "geometry", "stats", "metrics", "results", "hub"}
MAX_FLAT_MODULES = 10
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "tl_steering"
    top = parts[1]
    if top in PRIMITIVES:
        return "primitives"
    if top == "__main__":
        return "cli"
    return top


LEVEL = {name: i for i, names in enumerate(ORDER) for name in names}


def imports(module: str) -> set[str]:
    """The tl_steering modules ``module`` imports (``from P import m`` with m a module counts as P.m)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in MODULES and t != module}
    return out


GRAPH = {m: imports(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_is_in_a_room():
    assert {room(m) for m in MODULES} <= set(LEVEL), sorted({room(m) for m in MODULES} - set(LEVEL))


def test_no_import_cycle_between_modules():
    assert cycles(GRAPH) == []


def test_imports_run_down_the_room_order():
    up = [f"{m} imports {t} ({room(m)} -> {room(t)})" for m, ts in sorted(GRAPH.items()) for t in sorted(ts)
          if room(m) != room(t) and LEVEL[room(t)] >= LEVEL[room(m)]]
    assert up == []


def test_the_checker_sees_imports_inside_functions_and_finds_cycles():
    assert "tl_steering.probing.scan" in GRAPH["tl_steering.cli"]  # imported inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_at_most_ten_flat_modules():
    """Modules in tl_steering/ itself, besides the package's __init__.py and __main__.py (the rest is in rooms)."""
    flat = sorted(p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(flat) <= MAX_FLAT_MODULES, flat


def test_no_module_over_500_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_docs_architecture_names_every_room():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rooms = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    missing = sorted(r for r in rooms if not re.search(rf"`(?:tl_steering/)?{re.escape(r)}(/|\.py)`", text))
    assert missing == []
    order = re.search(r"^Import order: `(.+)`$", text, re.M)
    assert order is not None, "docs/architecture.md states the import order in a line 'Import order: `...`'"
    stated = [tuple(r.strip() for r in level.split("=")) for level in order.group(1).split("<")]
    assert stated == ORDER[:-1]  # the public surface (tl_steering/__init__.py) comes last and is not a room


#: torch's autodiff transforms: only tl_steering/backends/autodiff.py calls them (interrupt-safe sections, docs/hooks.md)
AUTODIFF_APIS = ("torch.func", "torch._functorch", "torch.autograd.forward_ad", "functorch")


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def autodiff_uses(source: str) -> list[int]:
    """Lines of ``source`` that name a torch autodiff transform API (attribute chains and imports)."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            names = [_dotted(node)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == api or n.startswith(api + ".") for n in names for api in AUTODIFF_APIS):
            lines.add(node.lineno)
    return sorted(lines)


def test_torch_func_transforms_run_only_through_backends_autodiff():
    """A KeyboardInterrupt inside a bare torch.func transform can leave forward AD broken for the process (issue 36):
    every transform goes through tl_steering.backends.autodiff (``autodiff.jvp``, ``autodiff.vmap(...)``...)."""
    bad = {m: lines for m, p in MODULES.items() if m != "tl_steering.backends.autodiff"
           and (lines := autodiff_uses(p.read_text(encoding="utf-8")))}
    assert bad == {}


def test_the_autodiff_checker_sees_calls_and_imports():
    assert autodiff_uses("import torch\ny = torch.func.vmap(f)(x)\n") == [2]
    assert autodiff_uses("from torch.func import jvp\n") == [1]
    assert autodiff_uses("import torch.autograd.forward_ad as fw\n") == [1]
    assert autodiff_uses("y = torch.autograd.functional.jvp(f, x, v)\n# torch.func.jvp in a comment\n") == []


def _mirror_misses() -> list[str]:
    """Unit test files whose name names no module of their room: ``tests/unit/<room>/test_<module>[_<topic>].py``
    (``tests/unit/test_<module>...`` for the flat modules and the CLI)."""
    misses = []
    for f in sorted((ROOT / "tests" / "unit").rglob("test_*.py")):
        rel = f.relative_to(ROOT / "tests" / "unit")
        pkg = PKG.joinpath(*rel.parts[:-1])
        stem = f.stem.removeprefix("test_")
        mods = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"} if pkg.is_dir() else set()
        if not any(stem == m or stem.startswith(m + "_") for m in mods):
            misses.append(str(rel))
    return misses


def test_unit_tests_mirror_the_tree():
    assert _mirror_misses() == []
