"""`--set KEY=VALUE`: the parser (and a fuzz of it), how overrides land on cluster.yaml's
mapping, and that an overridden value is validated exactly as the file's own, with
errors naming the override."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.controlplane.config import DEFAULT_CLUSTER_FILE, load_cluster_config, parse_cluster_yaml
from fleet.controlplane.config_overrides import Override, apply_overrides, parse_override, parse_overrides
from fleet.controlplane.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

FILE = "name: demo\nray:\n  nodes: 2\njob:\n  nodes: 1\n  ranks_per_node: 2\n  steps: 10\n"


def _load(tmp_path: Path, *sets: str, text: str = FILE):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return load_cluster_config(path, parse_overrides(list(sets)))


def _error(tmp_path: Path, *sets: str, text: str = FILE) -> str:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, *sets, text=text)
    message = str(info.value)
    assert "\n" not in message and info.value.hint, message
    return message


# -- the parser ---------------------------------------------------------------

@pytest.mark.parametrize(("text", "key", "value"), [
    ("job.steps=1000", ("job", "steps"), 1000),
    ("sdc.preflight=true", ("sdc", "preflight"), True),
    ("job.name=a: b", ("job", "name"), {"a": "b"}),  # YAML: a mapping; validation refuses it
    ("controller.heartbeat_timeout_s=2.5", ("controller", "heartbeat_timeout_s"), 2.5),
    ('job.entrypoint.args=[--lr, "0.1"]', ("job", "entrypoint", "args"), ["--lr", "0.1"]),
    ("chaos.faults=[{kind: crash, rank: 1, at_step: 5}]", ("chaos", "faults"),
     [{"kind": "crash", "rank": 1, "at_step": 5}]),
    ("store.url=sqlite:///x.db", ("store", "url"), "sqlite:///x.db"),  # only the first '=' splits
    ("job.name=a=b", ("job", "name"), "a=b"),
    (" job.steps =7", ("job", "steps"), 7),
    ("ray.address=", ("ray", "address"), None),  # YAML: nothing is null
    ('name="007"', ("name",), "007"),
])
def test_a_setting_is_a_dotted_key_and_one_yaml_value(text: str, key: tuple[str, ...], value: object) -> None:
    o = parse_override(text)
    assert (o.key, o.value, o.source) == (key, value, f"--set {text}")


@pytest.mark.parametrize(("text", "problem"), [
    ("job.steps", "--set job.steps: expected KEY=VALUE (no '=')"),
    ("=5", "--set =5: the key before '=' is empty"),
    ("  =5", "the key before '=' is empty"),
    ("job..steps=5", "'job..steps' has an empty part between dots"),
    (".steps=5", "has an empty part between dots"),
    ("job.=5", "has an empty part between dots"),
    ("job.steps=[1, 2", "--set job.steps=[1, 2: not one YAML value: expected ',' or ']'"),
    ('name="unterminated', "--set name=\"unterminated: not one YAML value"),
    ("name=a: b: c", "not one YAML value"),
    ("job.steps=*x", "not one YAML value"),
    ("job.name=2001-02-30", "not one YAML value"),
])
def test_a_bad_setting_is_a_config_error_naming_the_flag(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_override(text)
    assert problem in str(info.value) and str(info.value).startswith("--set ")
    assert info.value.hint and "\n" not in info.value.hint


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=60))
def test_fuzz_the_parser_raises_nothing_but_config_error(text: str) -> None:
    try:
        o = parse_override(text)
    except ConfigError as exc:
        assert str(exc).startswith("--set ") and "\n" not in str(exc)
        return
    assert "=" in text and o.key and all(part.strip() for part in o.key)


_KEY = st.lists(st.text(string.ascii_lowercase + "_", min_size=1, max_size=12), min_size=1, max_size=4)
_SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2 ** 63), max_value=2 ** 63),
    st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs",)), max_size=30),
)


@settings(max_examples=300, deadline=None)
@given(_KEY, _SCALAR)
def test_fuzz_simple_scalars_round_trip(key: list[str], value: object) -> None:
    # JSON is YAML: what a script writes with json.dumps comes back as it was
    o = parse_override(f"{'.'.join(key)}={json.dumps(value)}")
    assert o.key == tuple(key) and o.value == value and type(o.value) is type(value)


@settings(max_examples=200, deadline=None)
@given(_KEY, st.text(string.ascii_letters + string.digits + "-_./", min_size=1, max_size=20))
def test_fuzz_plain_words_are_strings_or_what_yaml_makes_of_them(key: list[str], word: str) -> None:
    o = parse_override(f"{'.'.join(key)}={word}")
    assert o.value == yaml.safe_load(word)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=4))
def test_fuzz_applying_to_the_default_file_fails_only_with_config_error(texts: list[str]) -> None:
    data = yaml.safe_load(DEFAULT_CLUSTER_FILE.read_text())
    try:
        apply_overrides(data, parse_overrides(texts))
    except ConfigError as exc:
        assert "\n" not in str(exc)


# -- applying -----------------------------------------------------------------

def test_overrides_apply_in_order_on_a_copy() -> None:
    data = {"job": {"steps": 10, "entrypoint": {"args": ["a"]}}, "chaos": {"faults": [{"kind": "crash"}]}}
    out = apply_overrides(data, parse_overrides(
        ["job.steps=5", "job.steps=6", "ray.nodes=3", "chaos.faults.0.rank=1", "job.entrypoint.args=[b]"]))
    assert out == {"job": {"steps": 6, "entrypoint": {"args": ["b"]}}, "ray": {"nodes": 3},
                   "chaos": {"faults": [{"kind": "crash", "rank": 1}]}}
    assert data["job"]["steps"] == 10 and data["chaos"]["faults"] == [{"kind": "crash"}]  # untouched


def test_an_empty_section_in_the_file_takes_keys() -> None:
    assert apply_overrides({"job": None}, [Override(("job", "steps"), 4, "--set job.steps=4")]) == {
        "job": {"steps": 4}}


@pytest.mark.parametrize(("text", "problem"), [
    ("job.steps.x=1", "--set job.steps.x=1: job.steps is 10, not a section with keys"),
    ("chaos.faults.3.kind=crash", "--set chaos.faults.3.kind=crash: chaos.faults is a list of 1 item(s); "
                                  "'3' is not an index in it (0 to 0)"),
    ("chaos.faults.x.kind=crash", "'x' is not an index in it"),
    ("chaos.faults.0.kind.deeper=1", "chaos.faults.0.kind is 'crash', not a section with keys"),
])
def test_a_path_through_a_value_is_an_error_naming_it(text: str, problem: str) -> None:
    data = {"job": {"steps": 10}, "chaos": {"faults": [{"kind": "crash"}]}}
    with pytest.raises(ConfigError) as info:
        apply_overrides(data, [parse_override(text)])
    assert str(info.value).startswith(f"--set {text}: ") and problem in str(info.value)


# -- validated as the file ----------------------------------------------------

def test_overridden_values_are_validated_and_used(tmp_path: Path) -> None:
    config = _load(tmp_path, "job.steps=1000", "controller.metrics_port=9100", "detect.hang.action=observe",
                   "ray.nodes=4", "job.nodes=3", "sdc.preflight=false")
    assert (config.job.steps, config.controller.metrics_port, config.ray.nodes, config.job.nodes) == (1000, 9100, 4, 3)
    assert config.detect.hang.action.value == "observe" and config.sdc.preflight is False
    # the job's stored config is the config itself: the overridden one
    stored = json.loads(config.model_dump_json())
    assert stored["job"]["steps"] == 1000 and stored["controller"]["metrics_port"] == 9100


def test_the_same_value_in_the_file_and_in_an_override_gives_the_same_config(tmp_path: Path) -> None:
    from_file = parse_cluster_yaml(FILE.replace("steps: 10", "steps: 77"), "f.yaml")
    assert _load(tmp_path, "job.steps=77") == from_file


@pytest.mark.parametrize(("sets", "problem"), [
    (["job.steps=abc"], "--set job.steps=abc: job.steps: Input should be a valid integer"),
    (["job.stpes=1"], "--set job.stpes=1: job.stpes: unknown key"),
    (["jbo.steps=1"], "--set jbo.steps=1: jbo: unknown key"),
    (["ray.nodes=0"], "--set ray.nodes=0: ray.nodes: Input should be greater than or equal to 1"),
    (["detect.hang.action=alert"], "--set detect.hang.action=alert: detect.hang.action: Input should be"),
    (["job=5"], "--set job=5: job: Input should be a valid dictionary"),
    # a rule across sections that names the key the override set
    (["job.nodes=5"], "--set job.nodes=5: job.nodes (5) exceeds the local cluster's ray.nodes (2)"),
    (["job.steps=5", "job.steps=x"], "--set job.steps=x: job.steps:"),  # the last one set it
])
def test_a_bad_override_is_named_in_the_error(tmp_path: Path, sets: list[str], problem: str) -> None:
    assert _error(tmp_path, *sets).startswith(problem)


def test_a_bad_key_in_the_file_is_still_the_files_with_its_line(tmp_path: Path) -> None:
    text = FILE + "  stepz: 3\n"
    assert _error(tmp_path, "job.steps=5", text=text).startswith(f"{tmp_path / 'cluster.yaml'}:8: job.stepz: unknown key")


def test_a_sections_rule_over_file_and_override_names_both(tmp_path: Path) -> None:
    # the file's builtin entrypoint with a program's args: the entrypoint section's own rule
    message = _error(tmp_path, 'job.entrypoint.args=[--lr, "0.1"]')
    assert re.match(rf"{re.escape(str(tmp_path / 'cluster.yaml'))}:\d+ with --set job\.entrypoint\.args=\[--lr, "
                    r'"0\.1"\]: job\.entrypoint: ', message), message


def test_a_rule_across_sections_names_the_file_and_what_was_set(tmp_path: Path) -> None:
    message = _error(tmp_path, "controller.heartbeat_interval_s=20", "controller.heartbeat_timeout_s=15")
    assert message.startswith("--set controller.heartbeat_timeout_s=15: ") or \
        message.startswith("--set controller.heartbeat_interval_s=20: "), message
    assert "heartbeat_interval_s must be < controller.heartbeat_timeout_s" in message
