"""The layout docs/architecture.md §2 describes, checked from the source (docs/architecture.md, "Layers").

Every ``import x`` and ``from x import y`` in the repo's packages is read with ``ast``
(function-level and ``TYPE_CHECKING`` imports included: a deferred import is still a
dependency) and each module is put in one layer:

* **core** — ``recserve.{config, catalog, scheduling, sharding, lookup, routing, rpc,
  client}``, plus ``recserve.errors`` (the one error hierarchy), ``recserve.v1`` (the
  generated wire stubs) and the bare ``recserve`` package module: they import no server
  package and nothing from the composition root;
* **servers** — ``embedding_server``, ``ranker``, ``cascade``, ``generation``: each imports
  the core and itself only, never another server and never the composition root;
* **composition root** — ``recserve.{cluster, cli, gateway, bench, loadtest}`` and
  ``recserve.__main__``: may import everything; nothing else imports a server.

Packages that do not exist yet are skipped, so a later package is covered the moment its
folder lands; a *new* ``recserve`` subpackage or top-level package (any folder at the repo
root with an ``__init__.py``, ``tests/`` aside) that is in no layer fails the test until
it is placed in one here (and in docs/architecture.md §2). A dotted string literal naming a repo module
(``importlib.import_module("embedding_server.server")``, a lazy-export table) counts as an
import for the layering rules, so a dynamic import cannot dodge them; it is not counted
for cycles (it runs only when called, never at import time).

A second check: imports inside the repo form no cycle (every import counted, deferred
ones too, so a cycle cannot hide behind a function-level import).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CORE = (
    "recserve.config",
    "recserve.catalog",
    "recserve.scheduling",
    "recserve.sharding",
    "recserve.lookup",
    "recserve.routing",
    "recserve.rpc",
    "recserve.client",
    "recserve.metrics",
    "recserve.errors",
    "recserve.logs",
    "recserve.v1",
)
SERVERS = ("embedding_server", "ranker", "cascade", "generation")
ROOT = ("recserve.cluster", "recserve.cli", "recserve.gateway", "recserve.bench", "recserve.loadtest", "recserve.deploy", "recserve.__main__")
TOP_LEVEL = ("recserve",) + SERVERS  # always scanned when present
NOT_PRODUCT = ("tests",)  # top-level packages that are not product code (protos/, docs/ have no __init__.py)


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement: ``module`` (importer) imports ``target`` at ``line``;
    ``deferred``: inside a function or an ``if TYPE_CHECKING:`` block; ``dynamic``: a
    string literal naming the module (``importlib.import_module``, lazy exports)."""

    module: str
    target: str
    line: int
    deferred: bool
    dynamic: bool = False


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def top_level_packages(root: Path) -> tuple[str, ...]:
    """The product's top-level packages under ``root``: :data:`TOP_LEVEL` plus every other
    folder there with an ``__init__.py`` (a new one is scanned, and fails as in no layer,
    the moment it lands), minus :data:`NOT_PRODUCT`."""
    found = {p.parent.name for p in root.glob("*/__init__.py") if p.parent.name.isidentifier()}
    return tuple(dict.fromkeys([*TOP_LEVEL, *sorted(found - set(TOP_LEVEL) - set(NOT_PRODUCT))]))


def repo_modules(root: Path, tops: Iterable[str] | None = None) -> dict[str, Path]:
    """Every module of the given top-level packages (default: :func:`top_level_packages`)
    under ``root``, by dotted name; packages that do not exist (yet) contribute nothing."""
    out: dict[str, Path] = {}
    for top in top_level_packages(root) if tops is None else tops:
        base = root / top
        if base.is_dir():
            for path in sorted(base.rglob("*.py")):
                out[module_name(root, path)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(body: list[ast.stmt], deferred: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Import nodes in ``body``, each with whether it runs only later (function body or
    TYPE_CHECKING block) rather than when the module is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, deferred
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    yield sub, True
        elif isinstance(node, ast.If):
            inner = deferred or _is_type_checking(node.test)
            yield from _walk(node.body, inner)
            yield from _walk(node.orelse, deferred)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    stmts = [c for c in children if isinstance(c, ast.stmt)]
                    for handler in (c for c in children if isinstance(c, ast.ExceptHandler)):
                        stmts.extend(handler.body)
                    yield from _walk(stmts, deferred)


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """The repo-internal imports of one module. ``from a import b`` counts as importing
    ``a.b`` when that is a module of the repo, else ``a``; relative imports are resolved.
    A dotted string literal equal to a module of ``known`` is a ``dynamic`` import of it."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    tops = set(TOP_LEVEL) | {name.split(".")[0] for name in known}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node, deferred in _walk(tree.body, False):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in dict.fromkeys(targets):
            if target.split(".")[0] in tops:
                found.append(Import(module, target, node.lineno, deferred))
    for sub in ast.walk(tree):
        # Dotted names only: a bare "ranker" or "cascade" is as often a config section.
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and "." in sub.value and sub.value in known and sub.value != module:
            found.append(Import(module, sub.value, sub.lineno, deferred=True, dynamic=True))
    return found


def _in(name: str, prefixes: Iterable[str]) -> str | None:
    return next((p for p in prefixes if name == p or name.startswith(p + ".")), None)


def layer_of(name: str) -> tuple[str, str] | None:
    """(layer, package) of a dotted module name, or None when it is in no layer."""
    if (p := _in(name, ROOT)) is not None:
        return "root", p
    if (p := _in(name, CORE)) is not None or name == "recserve":
        return "core", p or "recserve"
    if (p := _in(name, SERVERS)) is not None:
        return "server", p
    return None


def layering_violations(root: Path) -> list[str]:
    """Every import that breaks docs/architecture.md §2, as ``"file:line: a imports b (why)"``."""
    modules = repo_modules(root)
    known = set(modules)
    problems: list[str] = []
    for module, path in modules.items():
        where = f"{path.relative_to(root)}"
        mine = layer_of(module)
        if mine is None:
            problems.append(f"{where}: module {module} is in no layer; add its package to CORE, SERVERS or ROOT here and to docs/architecture.md §2")
            continue
        layer, package = mine
        for imp in imports_of(module, path, known):
            theirs = layer_of(imp.target)
            if theirs is None or theirs[1] == package:
                continue  # unknown targets are reported at their own module; self-imports are fine
            t_layer, t_package = theirs
            why = ""
            if layer == "core" and t_layer == "server":
                why = "the core imports no server package"
            elif layer == "core" and t_layer == "root":
                why = "the core imports nothing from the composition root"
            elif layer == "server" and t_layer == "server":
                why = f"server packages never import each other ({package} -> {t_package})"
            elif layer == "server" and t_layer == "root":
                why = "a server imports only the core (the composition root launches servers, not the reverse)"
            if why:
                problems.append(f"{where}:{imp.line}: {module} imports {imp.target} ({why})")
    return problems


def import_cycles(root: Path) -> list[list[str]]:
    """Strongly connected components (size > 1, or a module importing itself) of the
    repo's import graph, every import counted; each sorted, the list sorted."""
    modules = repo_modules(root)
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for imp in imports_of(module, path, known):
            if imp.target in known and not imp.dynamic:  # a dynamic import runs only when called
                graph[module].add(imp.target)
    # Tarjan's algorithm, iterative (deep import chains would hit the recursion limit).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    cycles.append(sorted(component))
    return sorted(cycles)


# -- the contract on this repo -----------------------------------------------------------


def test_the_repo_follows_the_layering_of_design_section_2() -> None:
    modules = repo_modules(REPO)
    assert "recserve.lookup.client" in modules and "embedding_server.server" in modules  # it really read the repo
    assert layering_violations(REPO) == []


def test_the_repo_has_no_import_cycle() -> None:
    assert import_cycles(REPO) == []


def test_every_product_package_is_packaged_and_type_checked() -> None:
    # The rule later issues follow: a new package goes into pyproject.toml's package list
    # and the Makefile's mypy PACKAGES when it lands.
    import re
    import tomllib

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packaged = {pattern.rstrip("*").rstrip(".") for pattern in include}
    line = re.search(r"^PACKAGES\s*:?=\s*(.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert line is not None, "the Makefile has no PACKAGES line"
    checked = set(line.group(1).split())
    present = {top for top in top_level_packages(REPO) if (REPO / top / "__init__.py").exists()}
    assert "recserve" in present and "embedding_server" in present
    assert sorted(present - packaged) == [], "add these to pyproject.toml [tool.setuptools.packages.find] include"
    assert sorted(present - checked) == [], "add these to the Makefile's PACKAGES (mypy)"


# -- the checker can fail ------------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for rel in files:  # every folder on the way is a package
        for parent in (root / rel).parents:
            if parent == root:
                break
            (parent / "__init__.py").touch()
    return root


def test_checker_reports_each_kind_of_violation_on_a_synthetic_tree(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            # core -> server, deferred inside a function: still a violation.
            "recserve/lookup/client.py": "def f():\n    from embedding_server import shard\n",
            # core -> composition root, relative import.
            "recserve/sharding/plan.py": "from ..cluster import shards\n",
            "recserve/cluster/shards.py": "import embedding_server.shard\nimport ranker\n",  # allowed
            # server -> server, `from package import module` form.
            "ranker/model.py": "from cascade import stages\n",
            "cascade/stages.py": "import recserve.lookup.client\n",  # allowed: server -> core
            # server -> composition root.
            "generation/engine.py": "if True:\n    import recserve.bench.knee\n",
            "recserve/bench/knee.py": "import generation.engine\n",  # allowed
            "embedding_server/shard.py": "import numpy\n",
            # a package in no layer.
            "recserve/mystery/thing.py": "",
        },
    )
    problems = layering_violations(root)
    joined = "\n".join(problems)
    assert "recserve.lookup.client imports embedding_server.shard (the core imports no server package)" in joined
    assert "recserve.sharding.plan imports recserve.cluster.shards (the core imports nothing from the composition root)" in joined
    assert "ranker.model imports cascade.stages (server packages never import each other (ranker -> cascade))" in joined
    assert "generation.engine imports recserve.bench.knee (a server imports only the core" in joined
    assert "module recserve.mystery is in no layer" in joined
    assert not any(p.split(": ", 1)[1].startswith(("recserve.cluster", "cascade.stages", "recserve.bench")) for p in problems), problems
    assert len([p for p in problems if "mystery" not in p]) == 4, problems


def test_checker_skips_missing_packages_and_finds_cycles_through_deferred_imports(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "recserve/scheduling/core.py": "from recserve.scheduling import view\n",
            "recserve/scheduling/view.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from recserve.scheduling.core import Scheduler\n",
            "recserve/sharding/plan.py": "def routers():\n    from recserve.sharding.router import TableRouter\n",
            "recserve/sharding/router.py": "from recserve.sharding.plan import Tier\n",
            "recserve/sharding/ring.py": "from . import ring\n",  # a module importing itself
        },
    )
    assert layering_violations(root) == []  # no ranker/cascade/generation folders: skipped, not an error
    assert import_cycles(root) == [
        ["recserve.scheduling.core", "recserve.scheduling.view"],
        ["recserve.sharding.plan", "recserve.sharding.router"],
        ["recserve.sharding.ring"],
    ]


def test_checker_covers_new_top_level_packages_and_dynamic_imports(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            # A top-level package nobody placed in a layer: scanned anyway, and reported.
            "gateway_server/app.py": "import embedding_server.shard\n",
            "embedding_server/shard.py": "import numpy\n",
            # A core module reaching a server through importlib: still a violation ...
            "recserve/lookup/client.py": "import importlib\ndef f():\n    return importlib.import_module('embedding_server.shard')\n",
            # ... but a lazy-export table is not an import cycle (it runs only when called),
            # and a bare word that happens to name a package ("ranker" config section) is no import.
            "recserve/sharding/__init__.py": "_EXPORTS = {'ShardingPlan': 'recserve.sharding.plan'}\n",
            "recserve/sharding/plan.py": "import recserve.sharding\n",
            "recserve/config/load.py": "SECTIONS = ('ranker', 'cascade')\n",
            "ranker/__init__.py": "",
        },
    )
    assert "gateway_server" in top_level_packages(root) and "tests" not in top_level_packages(REPO)
    problems = layering_violations(root)
    joined = "\n".join(problems)
    assert "module gateway_server.app is in no layer" in joined
    assert "recserve/lookup/client.py:3: recserve.lookup.client imports embedding_server.shard (the core imports no server package)" in joined
    assert len(problems) == 3, problems  # gateway_server and gateway_server.app in no layer, the dynamic import
    assert import_cycles(root) == []


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("recserve.errors", ("core", "recserve.errors")),
        ("recserve.v1.embedding_pb2", ("core", "recserve.v1")),
        ("recserve", ("core", "recserve")),
        ("recserve.__main__", ("root", "recserve.__main__")),
        ("recserve.bench.knee", ("root", "recserve.bench")),
        ("generation.engine", ("server", "generation")),
        ("recserve.benchmarks", None),  # a prefix match must end at a dot
    ],
)
def test_layer_of(name: str, want: tuple[str, str] | None) -> None:
    assert layer_of(name) == want
