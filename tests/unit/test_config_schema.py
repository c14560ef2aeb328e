"""`fleet config schema`: a JSON Schema (draft 2020-12) an editor's YAML language server
accepts, that agrees with what fleet validates; `fleet config show`: the config as fleet
runs it, overrides applied, its --minimal form a file that loads."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from fleet.controlplane.cli.config_cmd import SCHEMA_DIALECT, cluster_schema
from fleet.controlplane.cli.main import main
from fleet.controlplane.config import DEFAULT_CLUSTER_FILE, ClusterConfig, load_cluster_config, parse_cluster_yaml
from fleet.controlplane.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

EXAMPLES = sorted(DEFAULT_CLUSTER_FILE.parent.glob("*.yaml"))


@pytest.fixture(autouse=True)
def _no_fleet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FLEET_STORE", "FLEET_STATE_DIR", "FLEET_CLUSTER"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = cluster_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_schema_is_a_valid_2020_12_schema_of_an_object_with_every_section() -> None:
    schema = cluster_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == SCHEMA_DIALECT == "https://json-schema.org/draft/2020-12/schema"
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert schema["title"] == "fleet cluster.yaml" and "fleet up" in schema["description"]
    assert set(schema["properties"]) == set(ClusterConfig.model_fields)
    for section in ("ray", "controller", "store", "agent", "job", "policy", "chaos", "sdc", "detect"):
        assert section in schema["properties"], section
    # every key an editor completes carries the description fleet's own reference shows
    job = schema["$defs"]["JobConfig"]["properties"]
    assert job["steps"]["type"] == "integer" and job["steps"]["description"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_the_schema(validator: jsonschema.Draft202012Validator, example: Path) -> None:
    data = yaml.safe_load(example.read_text()) or {}
    assert [e.message for e in validator.iter_errors(data)] == []
    load_cluster_config(example)  # and fleet agrees


@pytest.mark.parametrize(("text", "path"), [
    ("job:\n  stepz: 3\n", ["job"]),                 # an unknown key
    ("job:\n  steps: many\n", ["job", "steps"]),     # a wrong type
    ("ray:\n  nodes: 0\n", ["ray", "nodes"]),        # out of bounds
    ("detect:\n  hang:\n    action: alert\n", ["detect", "hang", "action"]),  # not one of the choices
])
def test_what_fleet_refuses_the_schema_refuses_at_the_same_key(
        validator: jsonschema.Draft202012Validator, text: str, path: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse_cluster_yaml(text, "x.yaml")
    errors = list(validator.iter_errors(yaml.safe_load(text)))
    assert errors, text
    assert any(list(e.absolute_path)[:len(path)] == path or list(e.absolute_path) == path[:-1] for e in errors), \
        [(list(e.absolute_path), e.message) for e in errors]


def test_fleet_config_schema_prints_it_and_writes_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = _run(capsys, "config", "schema")
    assert code == 0, err
    assert json.loads(out) == cluster_schema()
    target = tmp_path / "cluster.schema.json"
    code, out, err = _run(capsys, "config", "schema", "--output", str(target))
    assert code == 0 and out == "" and str(target) in err
    assert json.loads(target.read_text()) == cluster_schema()
    code, out, err = _run(capsys, "config", "schema", "--output", str(tmp_path / "no" / "such" / "x.json"))
    assert code == ConfigError.exit_code
    error, hint = err.strip().splitlines()
    assert error.startswith("error: --output: cannot write") and hint.startswith("hint: ")


def test_config_show_prints_the_overridden_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "config", "show", "--set", "job.steps=1234", "--set", "controller.metrics_port=9101")
    assert code == 0, err
    header, _, body = out.partition("\n")
    assert header.startswith(f"# {DEFAULT_CLUSTER_FILE} as fleet runs it")
    shown = yaml.safe_load(body)
    assert shown["job"]["steps"] == 1234 and shown["controller"]["metrics_port"] == 9101
    # every key, defaults filled in: the whole model
    assert set(shown) == set(ClusterConfig.model_fields)
    assert shown["controller"]["heartbeat_timeout_s"] == load_cluster_config(DEFAULT_CLUSTER_FILE).controller.heartbeat_timeout_s


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_config_show_minimal_is_a_file_that_loads_as_the_same_config(
        capsys: pytest.CaptureFixture[str], example: Path) -> None:
    code, out, err = _run(capsys, "config", "show", "--minimal", "--cluster", str(example), "--set", "name=shown")
    assert code == 0, err
    again = parse_cluster_yaml(out, "shown.yaml")
    assert again == load_cluster_config(example).model_copy(update={"name": "shown"})


def test_config_show_with_a_bad_override_is_two_lines_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "config", "show", "--set", "job.steps=abc")
    assert code == ConfigError.exit_code and out == ""
    error, hint = err.strip().splitlines()
    assert error.startswith("error: --set job.steps=abc: job.steps: Input should be a valid integer")
    assert hint == "hint: `fleet config schema` describes every key; `fleet config show` prints the file as " \
                   "fleet reads it"
