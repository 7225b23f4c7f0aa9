"""The package graph points one way: core types -> kernels -> algorithm -> engines -> gateway / tools.

Read from the source (AST), every import counted, those inside functions too: a module may import modules of
its own layer or of a lower one, never of a higher one; and the modules' top-level imports form no cycle. The
layers are listed here, so that a new module has to be placed (the test names a module it cannot place).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("glance_sgl", "glance_kernels", "glance_server", "glance_loadtest")

# (layer, module prefixes); a module belongs to the layer of its longest matching prefix
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("glance_sgl.config", "glance_sgl.tree", "glance_sgl.acceptance", "glance_sgl.verify",
              "glance_sgl.metrics", "glance_sgl.law", "glance_sgl.special_tokens", "glance_sgl.host_transfers")),
    ("kernels", ("glance_kernels",)),
    ("algorithm", ("glance_sgl.costs", "glance_sgl.planner", "glance_sgl.round", "glance_sgl.drafter",
                   "glance_sgl.ngram_source")),
    ("engines", ("glance_sgl.target", "glance_sgl.engine", "glance_sgl.checkpoints", "glance_sgl.sglang")),
    ("tools", ("glance_sgl.cli", "glance_sgl.scale_timing", "glance_sgl.demo", "glance_sgl.train",
               "glance_sgl.sglang.bench", "glance_sgl.sglang.runner", "glance_sgl.sglang.launch",
               "glance_kernels.bench", "glance_server", "glance_loadtest")),
]
ROOTS = {"glance_sgl": "core"}  # the empty package __init__ files


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    if module in ROOTS:
        return [name for name, _ in LAYERS].index(ROOTS[module])
    best = (-1, -1)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best[1]:
                best = (i, len(p))
    assert best[0] >= 0, f"{module} is in no layer of tests/test_import_graph.py: place it"
    return best[0]


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Project modules ``path`` imports (``from a import b`` counts ``a`` and, when it is a module, ``a.b``)."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_every_package_folder_is_its_import_name():
    for pkg in PACKAGES:
        assert (ROOT / pkg / "__init__.py").is_file()
    assert not any((ROOT / old).exists() for old in ("kernels", "server", "loadtest"))


def test_imports_point_down_the_layers():
    mods = project_modules()
    names = [name for name, _ in LAYERS]
    bad = []
    for mod, path in sorted(mods.items()):
        mine = layer_of(mod)
        for dep in sorted(d for d in imports(path) if d in mods and d != mod):
            if layer_of(dep) > mine and not mod.startswith(dep + "."):
                bad.append(f"{mod} ({names[mine]}) imports {dep} ({names[layer_of(dep)]})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules():
    mods = project_modules()
    graph = {m: {d for d in imports(p, top_level_only=True) if d in mods and d != m} for m, p in mods.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if m.startswith(d + "."):
                continue  # a module importing its own package's __init__ (it runs first anyway)
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)
