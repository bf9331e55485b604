"""fxopt's import graph and its layer rule (ARCHITECTURE.md), read from the source with `ast`.

    python tests/import_layers.py      # every import, then the cycles and the upward imports

Both module-level imports and imports inside functions count (a function-level import is
still a dependency; it only hides a circle until the function runs).
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fxopt"

# Layers, lowest first, each a list of groups of module prefixes (a package prefix covers its
# submodules; the bare "fxopt" is the package's own __init__). A module may import its own group
# and any lower layer, nothing else: not a higher layer, and not another group of its own layer
# (capture and analysis do not import each other).
LAYERS: list[tuple[str, list[tuple[str, ...]]]] = [
    ("ground floor", [("fxopt.errors", "fxopt._version", "fxopt._torch_private", "fxopt.tree", "fxopt.state_preservation",
                       "fxopt.output_selection", "fxopt.op_names", "fxopt.graph_functions", "fxopt.model_copy",
                       "fxopt.running_modules", "fxopt.host_rng", "fxopt.user_code", "fxopt.collector", "fxopt.node_runner")]),
    ("capture and analyses", [("fxopt.capture",), ("fxopt.analysis",), ("fxopt.measure",)]),
    ("checkpointing", [("fxopt.checkpointing",)]),
    ("passes", [("fxopt.passes",)]),
    ("pipeline", [("fxopt.pipeline",)]),
    ("front ends", [("fxopt.frontends", "fxopt.__main__", "fxopt")]),
]


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    level: str  # "module" or "function"

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} ({self.level}-level, line {self.line})"


def modules(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known) -> list[str]:
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        candidates = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in known else prefix
                      for alias in node.names]
    resolved = []
    for target in candidates:
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in known and target != name:
            resolved.append(target)
    return resolved


def imports(package: pathlib.Path = PACKAGE) -> list[Import]:
    """Every import of one fxopt module by another, in source order."""
    known = modules(package)
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                level = "function" if id(node) in in_function else "module"
                found.extend(Import(name, target, node.lineno, level)
                             for target in _targets(name, path.name == "__init__.py", node, known))
    return sorted(set(found), key=lambda i: (i.importer, i.line, i.imported))


def layer_of(name: str) -> tuple[int, int] | None:
    """(layer index, group index within the layer) of a module, or None when no layer names it."""
    for index, (_, groups) in enumerate(LAYERS):
        for group_index, prefixes in enumerate(groups):
            if any(name == p or (p != "fxopt" and name.startswith(p + ".")) for p in prefixes):
                return index, group_index
    return None


def unassigned(package: pathlib.Path = PACKAGE) -> list[str]:
    return [name for name in modules(package) if layer_of(name) is None]


def upward(found: list[Import]) -> list[Import]:
    """Imports of a higher layer, or of a sibling group of the importer's own layer."""
    bad = []
    for imp in found:
        src, dst = layer_of(imp.importer), layer_of(imp.imported)
        if src and dst and (dst[0] > src[0] or (dst[0] == src[0] and dst[1] != src[1])):
            bad.append(imp)
    return bad


def private(found: list[Import]) -> list[Import]:
    """Imports of another package's private module (a name starting with one underscore, such as
    `fxopt.checkpointing._region_run`): only modules of that package may import it."""
    bad = []
    for imp in found:
        parts = imp.imported.split(".")
        for k, part in enumerate(parts[1:], start=1):
            if part.startswith("_") and not part.startswith("__") and k > 1:
                owner = ".".join(parts[:k])
                if not imp.importer.startswith(owner + ".") and imp.importer != owner:
                    bad.append(imp)
                break
    return bad


def cycles(found: list[Import]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for imp in found:
        graph.setdefault(imp.importer, []).append(imp.imported)
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def main() -> None:
    found = imports()
    for imp in found:
        print(imp)
    module_level = sum(i.level == "module" for i in found)
    print(f"\n{len(modules())} modules, {len(found)} imports ({module_level} module-level, "
          f"{len(found) - module_level} function-level)")
    circles = cycles(found)
    print(f"cycles: {len(circles)}" + "".join(f"\n  {len(c)} modules: {', '.join(c)}" for c in circles))
    bad = upward(found)
    print(f"upward imports: {len(bad)}" + "".join(f"\n  {i}" for i in bad))
    hidden = private(found)
    print(f"imports of another package's private module: {len(hidden)}" + "".join(f"\n  {i}" for i in hidden))
    print(f"modules with no layer: {unassigned() or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
