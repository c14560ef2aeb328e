"""The built wheel, installed into a fresh virtual environment, is a working fleet.

What is tested is the artifact a user installs, never the checkout: the working tree
(tracked and untracked files git does not ignore, so no stale ``build/`` or egg-info can
leak in) is copied to a temporary folder and built into a wheel offline (``pip wheel
--no-deps --no-build-isolation --no-index``: build isolation would have to download
setuptools; ``--check-build-dependencies`` still holds pyproject.toml's
``build-system.requires`` to what builds it), which is installed with ``--no-deps`` into
a venv made without system site-packages. Every command then runs as ``python -I -B``
from a folder outside the repository, so neither the checkout nor ``PYTHONPATH`` is on
``sys.path``, and no bytecode is written through the symlinks below into the project's
venv.

The heavy dependencies (torch, ray, grpc, ...) cannot be downloaded here, so the fresh
venv borrows them from the project's venv, honestly narrowed: a ``deps/`` folder holds
symlinks to the top-level files of exactly the distributions the wheel's
``Requires-Dist`` names, and their requirements transitively (extras and markers
evaluated), found through ``importlib.metadata``; one ``.pth`` file puts that folder on
the fresh venv's path, after its own site-packages. So a dependency the wheel forgets to
declare is missing there, and fleet's own modules can only come from the wheel (tests
below check every ``__file__``). The one leak: a namespace folder shared by several
distributions (``google/``) is linked whole.
"""

from __future__ import annotations

import ast
import email
import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench.fr_dumps import generate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
OLD_TOP_LEVEL = ("agent", "workers", "controlplane", "fleet_proto", "proto")
REQUIRED_COMMANDS = {"replay", "up", "jobs", "nodes", "report", "db", "inject-fault",
                     "quarantine", "release", "model-info"}
STEP_TIMEOUT_S = 300


@dataclass(frozen=True)
class Installed:
    wheel: Path
    python: Path        # the fresh venv's interpreter
    site: Path          # its site-packages
    fleet: Path         # its `fleet` console script
    elsewhere: Path     # a cwd outside the repository


def _run(cmd: list[str], cwd: Path, timeout: float = STEP_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd),
           "LANG": "C.UTF-8", "COLUMNS": "200", "TERM": "dumb"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess, what: str) -> str:
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _copy_worktree(dest: Path) -> None:
    """The working tree as git sees it: tracked plus untracked-but-not-ignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True, timeout=60).stdout
    for rel in filter(None, listed.decode().split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _dependency_closure(requires: list[str]) -> list[metadata.Distribution]:
    """Distributions the wheel's requirements pull in, found among this interpreter's.

    A direct requirement that is missing or at a version outside its specifier fails the
    test; a missing transitive one is left out (it is the dependency's own business, and
    an import that needs it fails below anyway)."""
    found: dict[str, metadata.Distribution] = {}
    done: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(r), "", True) for r in requires]
    while todo:
        req, extra, direct = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in done:
            continue
        done.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            assert not direct, f"fleet requires {req}, which is not installed in {sys.prefix}"
            continue
        if direct:
            assert req.specifier.contains(dist.version, prereleases=True), \
                f"fleet requires {req}, installed is {dist.version}"
        found[key[0]] = dist
        for r in dist.requires or []:
            todo += [(Requirement(r), e, False) for e in ("", *sorted(req.extras))]
    return list(found.values())


def _link_dependencies(dists: list[metadata.Distribution], deps: Path) -> None:
    """Symlink each distribution's top-level files (its RECORD's first path parts) into
    ``deps``; the dist-info folder too, so ``importlib.metadata`` sees the versions."""
    deps.mkdir()
    for dist in dists:
        base = Path(dist.locate_file(""))
        tops = {PurePosixPath(f).parts[0] for f in dist.files or []} or \
            set((dist.read_text("top_level.txt") or "").split())   # no RECORD: module names only
        for top in sorted(tops - {"..", "__pycache__"}):
            for name in (top, f"{top}.py"):
                if (base / name).exists() and not (deps / name).exists():
                    (deps / name).symlink_to(base / name, target_is_directory=(base / name).is_dir())
                    break


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    src, dist, env, elsewhere = root / "src", root / "dist", root / "env", root / "elsewhere"
    src.mkdir()
    elsewhere.mkdir()
    _copy_worktree(src)
    _ok(_run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
              "--check-build-dependencies", "-q", "-w", str(dist), str(src)], cwd=root), "pip wheel")
    (wheel,) = dist.glob("fleet-*.whl")

    venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True).create(env)
    python = env / "bin" / "python"
    _ok(_run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
              "-q", str(wheel)], cwd=root), "pip install")
    site = Path(_ok(_run([str(python), "-I", "-B", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         cwd=elsewhere), "locating site-packages").strip())

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        requires = email.message_from_string(zf.read(meta).decode()).get_all("Requires-Dist") or []
    assert requires, "the wheel's METADATA declares no dependencies"
    _link_dependencies(_dependency_closure(requires), root / "deps")
    (site / "_fleet_test_deps.pth").write_text(f"{root / 'deps'}\n")
    return Installed(wheel, python, site, env / "bin" / "fleet", elsewhere)


def _wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        return [line.split(",", 1)[0] for line in zf.read(record).decode().splitlines() if line]


def _roots() -> dict[str, str]:
    """setup.py's ROOTS (installed name -> folder), read without running setup()."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "ROOTS" for t in targets):
                return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no ROOTS")


def test_wheel_installs_only_the_fleet_namespace(installed):
    names = _wheel_names(installed.wheel)
    tops = {PurePosixPath(n).parts[0] for n in names if ".dist-info/" not in n}
    assert tops == {"fleet"}, f"the wheel installs top-level names {sorted(tops)}; only 'fleet' is ours"
    assert not tops & set(OLD_TOP_LEVEL)
    with zipfile.ZipFile(installed.wheel) as zf:
        top_level = [n for n in zf.namelist() if n.endswith(".dist-info/top_level.txt")]
        if top_level:
            assert zf.read(top_level[0]).decode().split() == ["fleet"]


def test_wheel_carries_every_module_and_data_file(installed):
    names = set(_wheel_names(installed.wheel))
    protos = sorted(p.name for p in (REPO / "proto" / "fleet" / "proto").glob("*.proto"))
    assert {"agent.proto", "control.proto", "events.proto"} <= set(protos)
    needed = {"fleet/examples/local.yaml", "fleet/controlplane/store/migrations/script.py.mako",
              *(f"fleet/proto/{p}" for p in protos)}
    assert not needed - names, f"missing from the wheel: {sorted(needed - names)}"
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
                             cwd=REPO, capture_output=True, text=True, check=True, timeout=60).stdout.split()
    expected = set()
    for name, folder in _roots().items():
        prefix = name.replace(".", "/")
        expected |= {f"{prefix}/{PurePosixPath(f).relative_to(folder)}" for f in tracked
                     if PurePosixPath(f).is_relative_to(folder)}
    assert not expected - names, f"modules missing from the wheel: {sorted(expected - names)}"


def test_fleet_imports_from_the_fresh_venv_only(installed):
    probe = """
import importlib, importlib.util, json, sys, fleet
fleet.record_collectives
mods = ["fleet", "fleet.controlplane", "fleet.controlplane.cli.main", "fleet.controlplane.store",
        "fleet.controlplane.controller", "fleet.agent", "fleet.agent.node_agent", "fleet.workers",
        "fleet.workers.flight", "fleet.workers.trainer", "fleet.proto", "fleet.proto.kinds"]
files = {m: importlib.import_module(m).__file__ for m in mods}
old = {n: (s.origin if (s := importlib.util.find_spec(n)) else None) for n in %r}
from fleet.controlplane.config import DEFAULT_CLUSTER_FILE, load_cluster_config
load_cluster_config(DEFAULT_CLUSTER_FILE)
print(json.dumps({"files": files, "old": old, "path": sys.path, "cluster": str(DEFAULT_CLUSTER_FILE),
                  "undeclared": [n for n in ("pytest", "hypothesis", "grpc_tools") if importlib.util.find_spec(n)],
                  "dist": str(importlib.metadata.distribution("fleet").locate_file(""))}))
""" % (OLD_TOP_LEVEL,)
    out = json.loads(_ok(_run([str(installed.python), "-I", "-B", "-c", "import importlib.metadata\n" + probe],
                              cwd=installed.elsewhere), "import probe"))
    for mod, file in out["files"].items():
        assert Path(file).is_relative_to(installed.site), f"{mod} imported from {file}, not the fresh venv"
    assert Path(out["dist"]) == installed.site
    assert Path(out["cluster"]).is_relative_to(installed.site), f"the default cluster.yaml is {out['cluster']}"
    assert not out["undeclared"], f"the fresh venv sees test-only packages {out['undeclared']}: not isolated"
    assert not any(Path(p).resolve() == REPO for p in out["path"] if p), f"the checkout is on sys.path: {out['path']}"
    for name, origin in out["old"].items():
        assert origin is None or not Path(origin).resolve().is_relative_to(REPO), \
            f"old top-level name {name!r} resolves into the checkout: {origin}"
    assert all(out["old"][n] is None for n in ("agent", "workers", "controlplane", "fleet_proto")), out["old"]


def _command_paths(installed: Installed) -> list[list[str]]:
    """Every command of the installed typer app, groups' subcommands included."""
    lister = """
import json, typer
from fleet.controlplane.cli.main import app
def walk(cmd, path):
    if hasattr(cmd, "commands"):  # a group; typer vendors click, so no isinstance
        yield path
        for name, sub in sorted(cmd.commands.items()):
            yield from walk(sub, path + [name])
    else:
        yield path
print(json.dumps([p for p in walk(typer.main.get_command(app), []) if p]))
"""
    return json.loads(_ok(_run([str(installed.python), "-I", "-B", "-c", lister], cwd=installed.elsewhere),
                          "listing commands"))


def test_every_command_has_help(installed):
    paths = _command_paths(installed)
    assert paths, "the installed app has no commands"
    top = {p[0] for p in paths}
    assert REQUIRED_COMMANDS <= top, f"missing commands: {sorted(REQUIRED_COMMANDS - top)}"
    _ok(_run([str(installed.python), "-I", "-B", str(installed.fleet), "--help"], cwd=installed.elsewhere), "fleet --help")
    for path in paths:
        out = _ok(_run([str(installed.python), "-I", "-B", str(installed.fleet), *path, "--help"],
                       cwd=installed.elsewhere, timeout=120), f"fleet {' '.join(path)} --help")
        assert f"fleet {' '.join(path)}" in out, f"no usage line for `fleet {' '.join(path)}`:\n{out}"


@pytest.mark.parametrize(("case", "culprit"), [("op_mismatch", 5), ("hang", 3)])
def test_replay_dumps_names_the_culprit(installed, tmp_path, case, culprit):
    dumps = tmp_path / "dumps"
    plant = generate(dumps, ranks=8, entries=300, case=case, culprit=culprit)
    out = _ok(_run([str(installed.python), "-I", "-B", str(installed.fleet), "replay", "--dumps", str(dumps), "--json"],
                   cwd=installed.elsewhere, timeout=120), "fleet replay --dumps")
    verdict = json.loads(out)
    assert (verdict["verdict"], verdict["culprit_ranks"]) == (plant.verdict, [culprit]), \
        json.dumps(verdict, indent=1)[:3000]


def test_db_upgrade_runs_the_packaged_migrations(installed, tmp_path):
    """The alembic scripts travel in the wheel: a new store is migrated to this tree's
    newest revision."""
    newest = max(p.name.split("_", 1)[0]
                 for p in (REPO / "controlplane" / "store" / "migrations" / "versions").glob("[0-9]*_*.py"))
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    fleet = [str(installed.python), "-I", "-B", str(installed.fleet), "db"]
    _ok(_run([*fleet, "upgrade", "--url", url], cwd=installed.elsewhere, timeout=120), "fleet db upgrade")
    state = json.loads(_ok(_run([*fleet, "current", "--url", url, "--json"], cwd=installed.elsewhere, timeout=120),
                           "fleet db current"))
    assert (state["state"], state["current"], state["head"]) == ("head", newest, newest), state
