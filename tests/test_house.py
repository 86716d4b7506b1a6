"""Issue 25, the house: imports run one way (tools -> training -> models -> mesa_ops) and no module
imports another that imports it back, lazy imports inside functions included."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("mesa_ops", "models", "training", "benchmarks")
LAYER = {"mesa_ops": 0, "models": 1, "training": 2, "benchmarks": 3}


def _modules() -> dict:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    return mods


def _imports(mods: dict) -> dict:
    """module -> the modules of these packages it imports anywhere in its file."""
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            edges[m].update(n for n in names if n in mods and n != m)
    return edges


def test_no_import_cycles_between_modules():
    mods = _modules()
    edges = _imports(mods)
    # a package's __init__ re-exports its modules: edges into an __init__ are the package itself
    edges = {m: {t for t in ts if mods[t].name != "__init__.py"} for m, ts in edges.items()}
    cycles = []
    for start in edges:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    cycles.append(" -> ".join(path + [start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    assert not cycles, cycles[:5]


def test_imports_run_one_way():
    edges = _imports(_modules())
    up = [f"{m} imports {t}" for m, ts in edges.items() for t in ts
          if LAYER[t.split(".")[0]] > LAYER[m.split(".")[0]]]
    assert not up, up
