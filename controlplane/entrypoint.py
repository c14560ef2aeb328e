"""Pre-flight checks of ``job.entrypoint``: the user's program exists before Ray starts.

``check_entrypoint(config, source)`` is called by `fleet up` and `fleet run` right after
the configuration is loaded: a missing script, module or working directory is one
``ConfigError`` line naming the key, not a failed attempt per rank minutes later. It
is a no-op for the built-in trainer.

It never imports or runs the user's code. A module's top-level name is looked for on
the filesystem as ``python -m`` would find it from the ranks' working directory: the
workdir first, then the entries of ``sys.path`` (packages with ``__init__.py``,
namespace packages spanning several folders, single-file and extension modules); a
name found nowhere there is asked of ``importlib.util.find_spec`` (installed modules
behind an import hook, a zip on the path, built-ins), which for a top-level name
imports nothing. Each further part is asked of the ``sys.meta_path`` finders with the
parent package's folders as the path: what the import system does once the parent is
imported, without importing it. A package must hold a ``__main__`` module to be run
with ``-m``.

Relative paths: ``workdir`` is relative to the current directory, ``script`` to workdir.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path

from fleet.controlplane.config import ClusterConfig
from fleet.controlplane.errors import ConfigError

_KEY = "job.entrypoint"


def check_entrypoint(config: ClusterConfig, source: str) -> None:
    """Raise ``ConfigError`` (``"<source>: job.entrypoint.<key>: <problem>"``, one line)
    when the program of ``config.job.entrypoint`` cannot be found; return quietly otherwise."""
    program = config.job.user_program
    if program is None:
        return
    workdir = resolve_workdir(program.workdir)
    checks = [("workdir", lambda: _workdir_problem(workdir))]
    if program.script is not None:
        script = program.script
        checks.append(("script", lambda: _script_problem(workdir / script)))
    if program.module is not None:
        module = program.module
        checks.append(("module", lambda: module_problem(module, workdir)))
    for key, check in checks:
        try:
            problem = check()
        except OSError as exc:  # e.g. a name too long for the filesystem
            problem = f"cannot be checked: {exc.strerror or exc}: {_shown(exc.filename or '')}"
        if problem:
            raise ConfigError(f"{source}: {_KEY}.{key}: {problem}")


def resolve_workdir(workdir: str | None) -> Path:
    """The ranks' working directory, absolute: ``workdir`` relative to the current
    directory, or the current directory itself when unset."""
    return Path.cwd() / workdir if workdir else Path.cwd()


def _shown(path: Path | str) -> str:
    """A path as one line of an error: quoted when it holds a newline or another
    character that does not print."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def _workdir_problem(workdir: Path) -> str:
    if workdir.is_dir():
        return ""
    return f"{'not a directory' if workdir.exists() else 'no such directory'}: {_shown(workdir)}"


def _script_problem(path: Path) -> str:
    """Why ``python PATH`` would not start, or "" (a file, or a folder with __main__.py)."""
    path = Path(path.absolute())
    if path.is_file():
        return ""
    if path.is_dir():
        return "" if (path / "__main__.py").is_file() else f"a directory without __main__.py: {_shown(path)}"
    return f"no such file: {_shown(path)}"


def module_problem(module: str, workdir: Path) -> str:
    """Why ``python -m MODULE`` run in ``workdir`` would find no module, or ""."""
    parts = module.split(".")
    found = _find_top_level(parts[0], _search_path(workdir))
    for depth in range(2, len(parts) + 1):
        if found is None:
            break
        found = _find_submodule(".".join(parts[:depth]), found.package_dirs)
    if found is None:
        return f"no module named {module!r} (looked in {_shown(workdir)} and the Python path)"
    if found.package_dirs and _find_submodule(f"{module}.__main__", found.package_dirs) is None:
        return f"{module!r} is a package without a __main__ module, so it cannot be run with -m"
    return ""


class _Found:
    """A module found: a package's folders (several for a namespace package), or none
    for a plain module."""

    def __init__(self, package_dirs: list[str]) -> None:
        self.package_dirs = package_dirs


def _search_path(workdir: Path) -> list[Path]:
    """Where ``python -m`` started in ``workdir`` looks for a top-level name: workdir,
    then ``sys.path`` (its "" entry is the current directory)."""
    places = [workdir]
    for entry in sys.path:
        path = Path(entry or ".").absolute()
        if path not in places:
            places.append(path)
    return places


def _module_files(folder: Path, name: str) -> Iterable[Path]:
    return (folder / f"{name}{suffix}" for suffix in importlib.machinery.all_suffixes())


def _find_on_disk(name: str, places: Iterable[Path]) -> _Found | None:
    """``name`` as a package, a module file or a namespace package in ``places``, in the
    import system's order: a regular package or module in an earlier place wins; folders
    without ``__init__.py`` only make a namespace package when nothing else is found."""
    namespace: list[str] = []
    for place in places:
        try:
            folder = place / name
            if folder.is_dir() and any(f.is_file() for f in _module_files(folder, "__init__")):
                return _Found([str(folder)])
            if any(f.is_file() for f in _module_files(place, name)):
                return _Found([])
            if folder.is_dir():
                namespace.append(str(folder))
        except OSError:  # an unreadable sys.path entry is skipped, as the import system does
            continue
    return _Found(namespace) if namespace else None


def _found(spec: importlib.machinery.ModuleSpec | None) -> _Found | None:
    if spec is None:
        return None
    return _Found(list(spec.submodule_search_locations or []))


def _find_top_level(name: str, places: list[Path]) -> _Found | None:
    """On disk from the ranks' workdir, else as the import system finds it here (an
    import hook, a zip on the path, a built-in): ``find_spec`` of a top-level name
    imports nothing."""
    found = _find_on_disk(name, places)
    if found is not None:
        return found
    try:
        return _found(importlib.util.find_spec(name))
    except (ImportError, ValueError):
        return None


def _find_submodule(fullname: str, parent_dirs: list[str]) -> _Found | None:
    """``fullname`` below its parent package's folders: on disk there, else asked of every
    finder on ``sys.meta_path`` with those folders as the path, as the import system would
    once the parent is imported, without importing it (an editable install's finder maps
    its subpackages this way; a zip on the path is read by its path hook)."""
    found = _find_on_disk(fullname.rpartition(".")[2], [Path(d) for d in parent_dirs])
    if found is not None:
        return found
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            # a namespace spec's locations are computed from the imported parent: read them here too
            found = _found(find(fullname, parent_dirs))
        except Exception:  # a finder failing only means it cannot tell us about this name
            continue
        if found is not None:
            return found
    return None
