"""Pre-flight checks of job.entrypoint: a missing program is one ConfigError line naming the
key, found without importing or running any of the user's code; and cluster.yaml's
entrypoint section, fuzzed, gives a valid config or a ConfigError naming a key."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.controlplane.config import ClusterConfig, parse_cluster_yaml
from fleet.controlplane.entrypoint import check_entrypoint
from fleet.controlplane.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


def _config(**entrypoint: Any) -> ClusterConfig:
    return parse_cluster_yaml(yaml.safe_dump({"job": {"entrypoint": entrypoint}}))


def _error(**entrypoint: Any) -> str:
    with pytest.raises(ConfigError) as info:
        check_entrypoint(_config(**entrypoint), "cluster.yaml")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_builtin_trainer_needs_no_check() -> None:
    check_entrypoint(parse_cluster_yaml(""), "cluster.yaml")


def test_a_missing_script_names_the_key_and_the_absolute_path(tmp_path: Path) -> None:
    assert _error(script="train.py", workdir=str(tmp_path)) == \
        f"cluster.yaml: job.entrypoint.script: no such file: {tmp_path}/train.py"


def test_a_script_is_relative_to_workdir_and_workdir_to_the_current_directory(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "proj" / "src").mkdir(parents=True)
    (tmp_path / "proj" / "src" / "train.py").write_text("raise SystemExit('never run')\n")
    monkeypatch.chdir(tmp_path)
    check_entrypoint(_config(script="src/train.py", workdir="proj"), "cluster.yaml")
    check_entrypoint(_config(script="proj/src/train.py"), "cluster.yaml")  # workdir unset: the current one
    assert _error(script="src/train.py") == f"cluster.yaml: job.entrypoint.script: no such file: {tmp_path}/src/train.py"


def test_a_script_may_be_a_folder_with_main(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    assert _error(script="app", workdir=str(tmp_path)) == \
        f"cluster.yaml: job.entrypoint.script: a directory without __main__.py: {tmp_path}/app"
    (tmp_path / "app" / "__main__.py").write_text("")
    check_entrypoint(_config(script="app", workdir=str(tmp_path)), "cluster.yaml")


def test_a_bad_workdir_comes_first(tmp_path: Path) -> None:
    assert _error(script="train.py", workdir=str(tmp_path / "nope")) == \
        f"cluster.yaml: job.entrypoint.workdir: no such directory: {tmp_path}/nope"
    (tmp_path / "file").write_text("")
    assert _error(module="m", workdir=str(tmp_path / "file")) == \
        f"cluster.yaml: job.entrypoint.workdir: not a directory: {tmp_path}/file"


def test_a_name_too_long_for_the_filesystem_is_a_config_error(tmp_path: Path) -> None:
    assert "job.entrypoint.script: cannot be checked" in _error(script="x" * 5000, workdir=str(tmp_path))


def test_a_path_with_a_newline_stays_on_one_line(tmp_path: Path) -> None:
    assert "no such file: " in _error(script="a\nb.py", workdir=str(tmp_path))


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


#: Importing any of these would leave a mark: the check must not run them.
EXPLODES = "import pathlib; pathlib.Path(__file__).with_name('RAN').write_text('x'); raise RuntimeError('ran')\n"


def test_modules_are_found_on_disk_without_running_them(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "single.py": EXPLODES,
        "pkg/__init__.py": EXPLODES, "pkg/__main__.py": EXPLODES, "pkg/sub/__init__.py": EXPLODES,
        "pkg/sub/train.py": EXPLODES, "nopkg/__init__.py": EXPLODES, "ns/deep/train.py": EXPLODES,
    })
    modules_before = set(sys.modules)
    for module in ("single", "pkg", "pkg.sub.train", "ns.deep.train"):
        check_entrypoint(_config(module=module, workdir=str(tmp_path)), "cluster.yaml")
    assert _error(module="pkg.sub.trian", workdir=str(tmp_path)) == (
        f"cluster.yaml: job.entrypoint.module: no module named 'pkg.sub.trian' "
        f"(looked in {tmp_path} and the Python path)")
    assert _error(module="nopkg", workdir=str(tmp_path)) == (
        "cluster.yaml: job.entrypoint.module: 'nopkg' is a package without a __main__ module, "
        "so it cannot be run with -m")
    assert _error(module="single.sub", workdir=str(tmp_path)).endswith(
        f"no module named 'single.sub' (looked in {tmp_path} and the Python path)")
    assert not list(tmp_path.rglob("RAN")), "a module of the user's was imported"
    assert set(sys.modules) - modules_before == set()


def test_a_namespace_package_spans_the_python_path(tmp_path: Path, monkeypatch) -> None:
    _tree(tmp_path, {"a/ns/one.py": EXPLODES, "b/ns/two.py": EXPLODES, "work/.keep": ""})
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    for module in ("ns.one", "ns.two"):
        check_entrypoint(_config(module=module, workdir=str(tmp_path / "work")), "cluster.yaml")
    assert "no module named 'ns.three'" in _error(module="ns.three", workdir=str(tmp_path / "work"))
    assert not list(tmp_path.rglob("RAN"))


def test_the_workdir_comes_before_the_python_path(tmp_path: Path, monkeypatch) -> None:
    # a regular package in the workdir hides a same-named one on the path, as `python -m` would
    _tree(tmp_path, {"work/pkg/__init__.py": "", "path/pkg/__init__.py": "", "path/pkg/__main__.py": ""})
    monkeypatch.syspath_prepend(str(tmp_path / "path"))
    assert "'pkg' is a package without a __main__ module" in _error(module="pkg", workdir=str(tmp_path / "work"))


@pytest.mark.parametrize("module", ["json.tool", "http.server", "torch.distributed.run", "fleet.workers.train"])
def test_installed_and_editable_modules_are_found(module: str, tmp_path: Path) -> None:
    # fleet.workers is mapped by the editable install's finder, not found below fleet/ on disk
    check_entrypoint(_config(module=module, workdir=str(tmp_path)), "cluster.yaml")


@pytest.mark.parametrize("module", ["torch.nope", "fleet.workers.nope", "no_such_top_level_module_xyz"])
def test_missing_installed_modules_are_named(module: str, tmp_path: Path) -> None:
    assert f"no module named {module!r}" in _error(module=module, workdir=str(tmp_path))


# -- fuzz: the entrypoint section of cluster.yaml ------------------------------------

_KEYS = ["module", "script", "args", "env", "workdir", "inherit_env", "tee"]
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=12),
    st.sampled_from(["train.py", "mypkg.train", "json.tool", "a..b", "1x", "RANK", "PATH", "/tmp", ".", "\0"]),
)
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.one_of(st.sampled_from(_KEYS), st.text(max_size=6)), inner, max_size=3),
), max_leaves=8)
_sections = st.one_of(
    _values,
    st.dictionaries(st.sampled_from(_KEYS), _values, max_size=5),
    st.fixed_dictionaries({}, optional={
        "module": st.one_of(st.sampled_from(["json.tool", "mypkg", "a.b.c", "x-y"]), _scalars),
        "script": st.one_of(st.sampled_from(["train.py", "examples/ddp_train.py", ""]), _scalars),
        "args": st.one_of(st.lists(st.text(max_size=5), max_size=3), _values),
        "env": st.one_of(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2), _values),
        "workdir": st.one_of(st.sampled_from([".", "nope", "/", "examples"]), _scalars),
        "inherit_env": _scalars, "tee": _scalars,
    }),
)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(section=_sections, recipe=st.sampled_from([{}, {"steps": 10}, {"nodes": 1}]))
def test_fuzzed_entrypoint_section_is_valid_or_names_a_key(section: Any, recipe: dict[str, Any]) -> None:
    text = yaml.safe_dump({"job": {**recipe, "entrypoint": section}}, allow_unicode=True)
    try:
        config = parse_cluster_yaml(text)
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith("<string>") and "\n" not in message
        assert ": job" in message, message  # job.entrypoint..., or job: for the section's own rules
        return
    try:
        check_entrypoint(config, "cluster.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("cluster.yaml: job.entrypoint.") and "\n" not in str(exc)
