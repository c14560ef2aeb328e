"""The dependency rules of DESIGN.md ("the arrows that must never exist"), checked on
the source with ``ast``; a violation names file:line and the rule.

    python scripts/import_rules.py      # every rule, its violations; exit 1 if any

tests/unit/test_import_rules.py runs each rule as one test case.

Every module of the ``fleet`` namespace is read (setup.py's ROOTS say which folder holds
which installed name; generated ``*_pb2*.py`` stubs are read only so that what they
import counts where a rule follows imports transitively, they are never a rule's
subject), plus tests/, bench/ and scripts/ for the rule against the old top-level
names. An import is every ``import``/``from ... import`` statement, relative ones
resolved, and every ``importlib.import_module("literal")``, wherever it sits: at module
level, in a function, or under ``if TYPE_CHECKING:``.

Which imports count:
  * Layering rules (workers, agent, SQLAlchemy, old names): all of them, TYPE_CHECKING
    and function-level included: a type-only import still couples the packages. One
    exception: a test may import an old top-level name inside ``try: ... except
    ImportError`` to prove it is not ours (test_proto_stubs does, for ``proto``).
  * Purity rules (diagnosis, decision logic import no torch/ray/grpc, transitively):
    every import in the subject's own modules, then, for each fleet module that pulls
    in, what importing it executes: its module-level imports and its parent packages.
    Function-level and TYPE_CHECKING imports of modules *outside* the subject are not
    followed (they run only if the subject calls that function; and ``fleet/__init__``
    reaches the torch-heavy flight recorder only lazily, by design). So a lazy import
    reached through another module's function is the one thing these rules cannot see.
  * Cycles: module-level imports only (TYPE_CHECKING and function-level imports are the
    usual, legitimate ways to break an import-time cycle).
"""

from __future__ import annotations

import ast
from collections import deque
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OLD_TOP_LEVEL = {"controlplane": "fleet.controlplane", "agent": "fleet.agent", "workers": "fleet.workers",
                 "fleet_proto": "fleet.proto", "proto": "fleet.proto"}   # old name -> its name now
OTHER_DIRS = ("tests", "bench", "scripts")
STORE = "fleet.controlplane.store"
DIAGNOSIS = "fleet.controlplane.diagnosis"
DECISION_LOGIC = ("fleet.controlplane.detectors", "fleet.controlplane.policy",
                  "fleet.controlplane.supervision", "fleet.controlplane.placement")
DECISION_LOGIC_REQUIRED = ("fleet.controlplane.detectors", "fleet.controlplane.policy",
                           "fleet.controlplane.supervision", "fleet.controlplane.placement")


@dataclass(frozen=True)
class Import:
    target: str         # absolute dotted name (``from a import b``: ``a.b`` when that is a module)
    line: int
    in_function: bool
    type_checking: bool
    level: int          # 0 for an absolute import
    guarded: bool       # in the body of a ``try`` that catches ImportError: a probe for absence

    @property
    def module_level(self) -> bool:
        return not (self.in_function or self.type_checking)


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    generated: bool
    imports: list[Import] = field(default_factory=list)


@dataclass
class Tree:
    """The modules of a source tree and what each imports."""

    base: Path
    fleet: dict[str, Module]    # installed name -> module
    other: list[Module]         # tests/, bench/, scripts/

    def where(self, m: Module, imp: Import) -> str:
        return f"{m.path.relative_to(self.base)}:{imp.line}"

    def under(self, prefix: str) -> list[Module]:
        return [m for n, m in sorted(self.fleet.items()) if _within(n, prefix) and not m.generated]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _parents(name: str) -> Iterator[str]:
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


def read_roots(setup_py: Path) -> dict[str, str]:
    """setup.py's ROOTS (installed name -> folder), read without running setup()."""
    for node in ast.parse(setup_py.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "ROOTS" for t in targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{setup_py} defines no ROOTS")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _catches_import_error(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError"}
    for h in node.handlers:
        caught = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        if any(isinstance(c, ast.Name) and c.id in names for c in caught):
            return True
    return False


def _raw_imports(tree: ast.Module) -> Iterator[tuple[ast.AST, bool, bool, bool]]:
    """``(node, in_function, type_checking, guarded)`` for every import statement or
    literal ``import_module`` call."""
    def visit(node: ast.AST, func: bool, tc: bool, guard: bool) -> Iterator[tuple[ast.AST, bool, bool, bool]]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, func, tc, guard
        elif isinstance(node, ast.Call) and _import_module_literal(node) is not None:
            yield node, func, tc, guard
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, func, True, guard)
            for child in node.orelse:
                yield from visit(child, func, tc, guard)
            return
        if isinstance(node, ast.Try) and _catches_import_error(node):
            for child in node.body:
                yield from visit(child, func, tc, True)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                yield from visit(child, func, tc, guard)
            return
        inner = func or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            yield from visit(child, inner, tc, guard)

    yield from visit(tree, False, False, False)


def _import_module_literal(call: ast.Call) -> str | None:
    f = call.func
    named = (isinstance(f, ast.Attribute) and f.attr == "import_module") or \
        (isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))
    if named and call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def _resolve(m: Module, node: ast.AST, known: set[str]) -> Iterator[tuple[str, int]]:
    """Absolute targets of one import node, with its level."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, 0
        return
    if isinstance(node, ast.Call):
        yield _import_module_literal(node), 0
        return
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        package = m.name if m.is_package else m.name.rpartition(".")[0]
        parts = package.split(".")
        anchor = ".".join(parts[: len(parts) - node.level + 1])
        base = f"{anchor}.{base}" if base else anchor
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield (sub if sub in known else base), node.level


def _module_name(path: Path, folder: Path, root: str) -> tuple[str, bool]:
    rel = path.relative_to(folder).with_suffix("").parts
    is_package = rel[-1] == "__init__"
    parts = rel[:-1] if is_package else rel
    return ".".join((root, *parts)), is_package


def scan(base: Path, roots: dict[str, str], other_dirs: tuple[str, ...] = OTHER_DIRS) -> Tree:
    """Read every module below ``base`` that ``roots`` and ``other_dirs`` name."""
    fleet: dict[str, Module] = {}
    claimed: set[Path] = set()
    # deepest folder first: a root's folder inside another's is that root's, not the outer one's
    for root, folder in sorted(roots.items(), key=lambda kv: -len(Path(kv[1]).parts)):
        for path in sorted((base / folder).rglob("*.py")):
            if "__pycache__" in path.parts or path in claimed:
                continue
            claimed.add(path)
            name, pkg = _module_name(path, base / folder, root)
            fleet[name] = Module(name, path, pkg, generated="_pb2" in path.name)
    other = [Module(_module_name(p, base, "")[0].lstrip("."), p, p.name == "__init__.py", False)
             for d in other_dirs for p in sorted((base / d).rglob("*.py")) if "__pycache__" not in p.parts]
    known = set(fleet)
    for m in [*fleet.values(), *other]:
        tree = ast.parse(m.path.read_text(), filename=str(m.path))
        found = {Import(target, node.lineno, func, tc, level, guard): None
                 for node, func, tc, guard in _raw_imports(tree) for target, level in _resolve(m, node, known)}
        m.imports = list(found)   # a dict, not a set: keeps source order, drops `from a import b, c` twins
    return Tree(base, fleet, other)


# --- the rules ------------------------------------------------------------------------

def forbid_direct(subject: str, forbidden: Callable[[str], bool], what: str) -> Callable[[Tree], list[str]]:
    """Modules under ``subject`` import nothing ``forbidden`` says, in any way."""
    def check(tree: Tree) -> list[str]:
        return [f"{tree.where(m, i)}: {m.name} imports {i.target}: {what}"
                for m in tree.under(subject) for i in m.imports if forbidden(i.target)]
    return check


def forbid_outside(owner: tuple[str, ...], tops: set[str], what: str) -> Callable[[Tree], list[str]]:
    """Only modules under one of ``owner`` import the top-level names ``tops``."""
    def check(tree: Tree) -> list[str]:
        return [f"{tree.where(m, i)}: {m.name} imports {i.target}: {what}"
                for m in tree.under("fleet") if not any(_within(m.name, o) for o in owner)
                for i in m.imports if i.target.split(".")[0] in tops]
    return check


def _heavy(target: str) -> str | None:
    """Which forbidden dependency ``target`` belongs to: torch and its extensions (``torchvision``),
    ray, grpc and its companion distributions (``grpc_health``, ``grpc_tools``)."""
    top = target.split(".")[0]
    if top.startswith("torch"):
        return "torch"
    if top == "ray":
        return "ray"
    if top == "grpc" or top.startswith("grpc_"):
        return "grpc"
    return None


def forbid_transitive(subjects: tuple[str, ...], required: tuple[str, ...], what: str) -> Callable[[Tree], list[str]]:
    """Nothing the modules under ``subjects`` import, transitively (see the module
    docstring for which edges are followed), is torch, ray or grpc."""
    def check(tree: Tree) -> list[str]:
        missing = [s for s in required if not tree.under(s)]
        assert not missing, f"the rule's subjects are gone (rename the rule with them): {missing}"
        own = {m.name for s in subjects for m in tree.under(s)}
        via: dict[str, str | None] = {n: None for n in own}
        todo = deque(sorted(own))
        while todo:
            name = todo.popleft()
            m = tree.fleet[name]
            for i in m.imports:
                if name not in own and not i.module_level:
                    continue
                for t in (*_parents(i.target), i.target):
                    if t in tree.fleet and t not in via:
                        via[t] = name
                        todo.append(t)
            for parent in _parents(name):
                if parent in tree.fleet and parent not in via:
                    via[parent] = name
                    todo.append(parent)
        out = []
        for name in sorted(via):
            m = tree.fleet[name]
            for i in m.imports:
                heavy = _heavy(i.target)
                if heavy and (name in own or i.module_level):
                    chain = [name]
                    while via[chain[-1]] is not None:
                        chain.append(via[chain[-1]])
                    out.append(f"{tree.where(m, i)}: {name} imports {i.target} ({heavy}), "
                               f"reached by {' <- '.join(chain)}: {what}")
        return out
    return check


def no_old_names(tree: Tree) -> list[str]:
    """No absolute import of a pre-namespace top-level name, anywhere. The one exception:
    a test may probe that such a name is *not* ours, inside ``try: ... except
    ImportError`` (test_proto_stubs does, for proto-plus's ``proto``)."""
    def probe(m: Module, i: Import) -> bool:
        return i.guarded and m.name.startswith("tests.")

    mods = [m for m in tree.fleet.values() if not m.generated] + tree.other
    return [f"{tree.where(m, i)}: {m.name} imports {i.target}: the old top-level name "
            f"{i.target.split('.')[0]!r}; import {OLD_TOP_LEVEL[i.target.split('.')[0]]} instead"
            for m in mods for i in m.imports
            if i.level == 0 and i.target.split(".")[0] in OLD_TOP_LEVEL and not probe(m, i)]


def no_cycles(tree: Tree) -> list[str]:
    """No cycle among fleet modules' module-level imports (an import runs the target and
    its parent packages, except those the importer is itself inside)."""
    edges: dict[str, dict[str, Import]] = {n: {} for n in tree.fleet}
    for name, m in tree.fleet.items():
        mine = set(_parents(name)) | {name}
        for i in m.imports:
            if i.module_level:
                for t in (*_parents(i.target), i.target):
                    if t in tree.fleet and t not in mine:
                        edges[name].setdefault(t, i)
    out, seen = [], set()
    for scc in _strongly_connected(edges):
        if len(scc) > 1 and not scc & seen:
            seen |= scc
            cycle = _one_cycle(edges, scc)
            steps = [f"{tree.where(tree.fleet[a], edges[a][b])} {a} -> {b}" for a, b in zip(cycle, cycle[1:])]
            out.append("import cycle among " + ", ".join(sorted(scc)) + ":\n    " + "\n    ".join(steps))
    return out


def _strongly_connected(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan; fleet's import depth is far below the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on.discard(w)
                scc.add(w)
                if w == v:
                    break
            out.append(scc)

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def _one_cycle(edges: dict[str, dict[str, Import]], scc: set[str]) -> list[str]:
    """A shortest cycle through the SCC's first module, as a closed list of names."""
    start = min(scc)
    prev: dict[str, str] = {}
    todo = deque([start])
    while todo:
        v = todo.popleft()
        for w in sorted(edges[v]):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if w in scc and w not in prev:
                prev[w] = v
                todo.append(w)
    raise AssertionError(f"no cycle through {start}")


RULES: dict[str, Callable[[Tree], list[str]]] = {
    "workers-import-no-controlplane-or-agent": forbid_direct(
        "fleet.workers", lambda t: _within(t, "fleet.controlplane") or _within(t, "fleet.agent"),
        "a worker speaks only the wire contract (fleet.proto) to its node agent"),
    "agent-imports-no-store": forbid_direct(
        "fleet.agent", lambda t: _within(t, STORE), "the agent never touches the store"),
    "agent-imports-no-controlplane": forbid_direct(
        "fleet.agent", lambda t: _within(t, "fleet.controlplane"),
        "the agent talks to the controller only over gRPC (fleet.proto)"),
    "diagnosis-imports-no-torch-ray-grpc": forbid_transitive(
        (DIAGNOSIS,), (DIAGNOSIS,),
        "the diagnosis engine is pure Python over traces, so `fleet replay --dumps` runs anywhere"),
    "sqlalchemy-only-in-store": forbid_outside(
        (STORE,), {"sqlalchemy", "alembic"}, "SQLAlchemy and alembic stay inside fleet.controlplane.store"),
    "decision-logic-imports-no-ray-grpc": forbid_transitive(
        DECISION_LOGIC, DECISION_LOGIC_REQUIRED,
        "decision logic takes snapshots and returns decisions; servers and the orchestrator carry them out"),
    "no-old-top-level-names": no_old_names,
    "no-import-cycles": no_cycles,
}


def main() -> int:
    """Print every violation of this checkout, one rule after another; exit 1 if any."""
    tree = scan(REPO, read_roots(REPO / "setup.py"))
    broken = 0
    for rule, check in RULES.items():
        violations = check(tree)
        broken += bool(violations)
        print(f"{rule}: {'ok' if not violations else f'{len(violations)} violation(s)'}")
        for v in violations:
            print(f"  {v}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
