"""The project's import graph: which of our modules each module imports (function-level and
TYPE_CHECKING imports count), in dependency order, and any import cycle.

    python scripts/import_graph.py                 # engine and realtime; exit 1 on a cycle
    python scripts/import_graph.py realtime --md   # the table docs/architecture.md shows

A cycle means two modules cannot be understood, tested or replaced apart; tests/test_import_graph.py
keeps the tree free of them.
"""

from __future__ import annotations

import argparse
import ast
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_files(packages: list[str]) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `name` imports; `from pkg import mod` counts as importing `pkg.mod`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            # a module's own package (its __init__) is not a dependency of the module
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def graph(packages: list[str]) -> dict[str, set[str]]:
    known = module_files(packages)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("packages", nargs="*", default=["engine", "realtime"])
    ap.add_argument("--md", action="store_true", help="a Markdown table, lowest layer first")
    args = ap.parse_args(argv)
    g = graph(args.packages)
    found = cycles(g)
    for comp in found:
        print("import cycle: " + " <-> ".join(comp), file=sys.stderr)
    if found:
        return 1
    try:
        order = list(TopologicalSorter(g).static_order())
    except CycleError:  # cannot happen after cycles() found none; kept for a clear message
        return 1
    if args.md:
        print("| module | imports (of ours) |\n|---|---|")
    for name in order:
        deps = ", ".join(sorted(g[name])) or "-"
        print(f"| `{name}` | {deps} |" if args.md else f"{name}: {deps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
