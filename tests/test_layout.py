"""The package layout keeps its rules (docs/architecture.md, "Modules"): every import runs down
the floors or within one folder without a circle, no module uses another's private helper, the
package root holds few modules, and no function is over 80 lines."""

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "gsm8kctl"

# Top to bottom; a module may import from its own floor's folder or from any floor below it.
FLOORS = [
    {"cli", "__main__"},
    {"loop"},
    {"stages"},
    {"sampling", "browse"},
    {"training"},
    {"config"},
    {"artifacts"},
    {"agent", "oom", "progress", "procs", "errors", "__init__"},
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = p
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gsm8kctl"):
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("gsm8kctl")]
        for name in names:
            name = name.removeprefix("gsm8kctl").lstrip(".")
            if name in modules:
                found.add(name)
                break
    return found


def _floor(module: str) -> int:
    top = module.split(".")[0] or "__init__"
    return next(i for i, floor in enumerate(FLOORS) if top in floor)


def test_imports_run_down_the_floors_without_circles():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m, ""} for m, p in modules.items()}
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps if _floor(d) < _floor(m)]
    assert not upward, upward
    # A circle through any folder (within a floor too).
    seen, stack, circles = set(), [], []

    def visit(m):
        if m in stack:
            circles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in graph.get(m, ()):
            visit(d)
        stack.pop()

    for m in graph:
        visit(m)
    assert not circles, circles


def test_no_module_uses_another_modules_private_helpers():
    used = defaultdict(list)
    for m, p in _modules().items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gsm8kctl"):
                used[m] += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not {m: names for m, names in used.items() if names}


def test_the_package_root_holds_few_modules():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 10, root


def test_no_function_is_over_80_lines():
    long = []
    for m, p in _modules().items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{m}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long
