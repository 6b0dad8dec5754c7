#!/usr/bin/env python3
"""The house rules of genq's code, measured: prints what it found and exits 1 on a breach.

- no import circles between genq's modules;
- layers: the core (genq.core) imports nothing of genq above it; genq.sim imports
  nothing else of genq; nothing imports the CLI (genq.cli) but the CLI itself and
  genq/__main__.py;
- no size cap: the rule is one job per module, named for that job, as long as that job needs
  (a cap made modules split to fit it, not by job); the largest files are printed to be seen;
- the ledger's boundary (issue #23): only the ledger's modules (LEDGER, and every module of the
  genq.core.ledger package) import rq (RQ is the ledger's transport, nobody else's) or build a
  Redis key (import genq.core.keys), and no module holds a Lua script (`redis.call(` in a .py
  file): every script is a .lua file in genq/core/scripts/, loaded by genq.core.scripts.
  KEYED_YET lists the modules outside the ledger that still build keys, each with its reason; a
  module not listed that imports genq.core.keys is a breach, and so is a listed one that no
  longer does (take it off the list): the list only shrinks.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "genq"
# Which genq packages each layer may import (besides itself).
ALLOWED = {
    "genq.core": {"genq.core"},
    "genq.sim": {"genq.sim"},
    "genq.output": {"genq.core", "genq.output"},
}
# The modules that own a batch's life in Redis: the Lua scripts' loader, the ledger and the RQ
# transport (queueing).
LEDGER = {
    "genq.core.scripts",
    "genq.core.ledger",  # and its modules: genq/core/ledger/ (in_ledger)
    "genq.core.queueing",
}
# The modules outside the ledger that still build Redis keys, and why; none may be added (empty
# since 2026-12-03: the last six moved their keys into genq/core/ledger/).
KEYED_YET: dict[str, str] = {}


def in_ledger(name: str) -> bool:
    return name in LEDGER or name.startswith("genq.core.ledger.")


def package_folders() -> dict[str, Path]:
    """Package name -> folder: genq/ and the top-level folders pyproject.toml's package-dir maps into it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {"genq": PACKAGE, **{name: ROOT / folder for name, folder in config["package-dir"].items()}}


def genq_files() -> dict[str, Path]:
    """Every module of the installed package, by its dotted name."""
    found = {}
    for package, folder in package_folders().items():
        for path in folder.rglob("*.py"):
            parts = [*package.split("."), *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return dict(sorted(found.items()))


def imports_of(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {i for i in found if i == "genq" or i.startswith("genq.")}


def imports_rq(path: Path) -> bool:
    """Whether the module imports rq anywhere (a function's own import counts too); imports for
    the type checker only (`if TYPE_CHECKING:`) do not: they tie nothing to RQ when genq runs."""
    def names(node: ast.AST) -> Iterator[str]:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                yield from names(child)
            return
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.module or ""
        for child in ast.iter_child_nodes(node):
            yield from names(child)

    return any(n == "rq" or n.startswith("rq.") for n in names(ast.parse(path.read_text(), str(path))))


def boundary(modules: dict[str, Path], graph: dict[str, set[str]],
             keyed_yet: dict[str, str] = KEYED_YET) -> tuple[list[str], list[str]]:
    """Breaches of the ledger's boundary; the modules outside it that build keys (genq.core.keys)."""
    breaches = []
    for name, path in modules.items():
        if not in_ledger(name) and imports_rq(path):
            breaches.append(f"ledger: {name} imports rq (only {sorted(LEDGER)} may: RQ is the ledger's transport)")
        if "redis.call(" in path.read_text():
            breaches.append(f"ledger: {name} holds a Lua script: it goes in genq/core/scripts/ as a .lua file")
    keyed = sorted(n for n, deps in graph.items() if "genq.core.keys" in deps and not in_ledger(n))
    for name in keyed:
        if name not in keyed_yet:
            breaches.append(f"ledger: {name} builds Redis keys (imports genq.core.keys): ask the ledger "
                            "(genq/core/ledger/) instead, or add a function there")
    for name in sorted(set(keyed_yet) - set(keyed)):
        breaches.append(f"ledger: {name} no longer builds keys: take it off check_layout.KEYED_YET")
    return breaches, keyed


def resolve(target: str, modules: dict[str, Path]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def layer(name: str) -> str | None:
    return next((lay for lay in ALLOWED if name == lay or name.startswith(lay + ".")), None)


def main() -> int:
    modules = genq_files()
    graph: dict[str, set[str]] = {}
    breaches: list[str] = []
    for name, path in modules.items():
        deps = {d for i in imports_of(path, name) if (d := resolve(i, modules)) and d != name and d != "genq"}
        graph[name] = deps
        own = layer(name)
        for dep in sorted(deps):
            if own and not any(dep == a or dep.startswith(a + ".") for a in ALLOWED[own]):
                breaches.append(f"layer: {name} imports {dep} ({own} may import only {sorted(ALLOWED[own])})")
            if (dep == "genq.cli" or dep.startswith("genq.cli.")) and not name.startswith("genq.cli") \
                    and name != "genq.__main__":
                breaches.append(f"leaf: {name} imports the CLI module {dep}")
    for cycle in cycles(graph):
        breaches.append("circle: " + " -> ".join(cycle))
    ledger_breaches, keyed = boundary(modules, graph)
    breaches += ledger_breaches
    sizes = []
    for path in sorted({*modules.values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")}):
        sizes.append((len(path.read_text().splitlines()), path))
    edges = sum(len(d) for d in graph.values())
    largest = ", ".join(f"{p.relative_to(ROOT)} {n}" for n, p in sorted(sizes, reverse=True)[:3])
    print(f"layout: {len(modules)} modules, {edges} imports between them, {len(sizes)} files measured; "
          f"largest: {largest}")
    print(f"ledger: {len(keyed)} modules outside it still build Redis keys (genq.core.keys; KEYED_YET): "
          f"{', '.join(keyed) or 'none'}")
    for line in breaches:
        print("  " + line)
    print("layout: ok" if not breaches else f"layout: {len(breaches)} breach(es)")
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
