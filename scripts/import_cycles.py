"""Print every import circle among the project's modules (app, services, gyre); exit 1 if any.

Usage: python scripts/import_cycles.py

A circle is a strongly connected set of two or more modules in the import graph that grimp (the
library under import-linter) builds from the source, imports under `if TYPE_CHECKING:` included:
a circle that only type checkers follow is still two modules that cannot be read apart.
The generated contracts (gyre.v1) are left out. tests/test_layers.py runs the same check.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "services", "gyre")


def import_cycles() -> list[list[str]]:
    """The circles, each a sorted list of module names, largest first."""
    import grimp

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    modules = sorted(m for m in graph.modules if not m.startswith("gyre.v1"))
    edges = {
        m: sorted(d for d in graph.find_modules_directly_imported_by(m) if d in modules) for m in modules
    }
    return [sorted(c) for c in _strongly_connected(modules, edges) if len(c) > 1]


def _strongly_connected(nodes: list[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit on deep graphs)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            succ = edges[node]
            if i < len(succ):
                work.append((node, i + 1))
                nxt = succ[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                out.append(comp)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(out, key=len, reverse=True)


def main() -> int:
    cycles = import_cycles()
    for cycle in cycles:
        print("import circle: " + " <-> ".join(cycle))
    print(f"{len(cycles)} import circle(s) among {', '.join(PACKAGES)}")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
