"""cluster.yaml parsing: the embedded default, one test per kind of error, fuzzing, README sync."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from fleet.controlplane.config import (
    DEFAULT_CLUSTER_FILE,
    ClusterConfig,
    load_cluster_config,
    parse_cluster_yaml,
)
from fleet.controlplane.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
SRC = "x.yaml"


def _error(text: str) -> str:
    """The one-line message parse_cluster_yaml raises for ``text``."""
    with pytest.raises(ConfigError) as info:
        parse_cluster_yaml(text, SRC)
    return str(info.value)


# -- the embedded default ------------------------------------------------------------


def test_default_file_is_examples_local_yaml() -> None:
    assert DEFAULT_CLUSTER_FILE == REPO / "examples" / "local.yaml"
    assert DEFAULT_CLUSTER_FILE.is_file()


def test_examples_local_yaml_loads() -> None:
    cfg = load_cluster_config(REPO / "examples" / "local.yaml")
    assert cfg.ray.address is None
    assert cfg.ray.nodes >= 2
    assert cfg.job.nodes >= 2
    assert cfg.job.ranks_per_node == 2
    assert cfg.job.world_size == cfg.job.nodes * 2
    assert cfg.job.model.preset == "tiny"
    assert cfg.store.url.startswith("sqlite:///")
    assert ".fleet/" in cfg.store.url
    assert cfg.job.seq_len <= cfg.job.model.args().max_seq_len
    c = cfg.controller
    assert c.heartbeat_interval_s < c.heartbeat_timeout_s < cfg.job.pg_timeout_s


def test_empty_file_gives_defaults() -> None:
    for text in ("", "\n", "# nothing but a comment\n", "---\n"):
        assert parse_cluster_yaml(text, SRC) == ClusterConfig()


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path)
    assert str(path) in str(info.value)
    assert "no such file" in str(info.value)


def test_undecodable_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path)
    assert str(info.value).startswith(str(path))


def test_loaded_file_errors_name_the_path(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("name: ok\nbogus: 1\n")
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path)
    assert str(info.value) == f"{path}:2: bogus: unknown key"


# -- each kind of error names the file, the key and the line ----------------------------


def test_wrong_type_names_key_and_line() -> None:
    msg = _error("name: demo\njob:\n  steps: many\n")
    assert msg.startswith(f"{SRC}:3: job.steps: ")
    assert "integer" in msg


def test_out_of_range_names_key_and_line() -> None:
    msg = _error("ray:\n  cpus_per_node: 4\n  nodes: 0\n")
    assert msg.startswith(f"{SRC}:3: ray.nodes: ")
    assert "greater than or equal to 1" in msg


def test_port_above_range() -> None:
    msg = _error("controller:\n  port: 70000\n")
    assert msg.startswith(f"{SRC}:2: controller.port: ")
    assert "65535" in msg


def test_unknown_top_level_key_names_key_and_line() -> None:
    assert _error("name: demo\nstate_dir: .fleet\nbogus: 1\n") == f"{SRC}:3: bogus: unknown key"


def test_unknown_nested_key_names_dotted_key_and_line() -> None:
    text = "job:\n  steps: 10\n  model:\n    preset: tiny\n    depth: 3\n"
    assert _error(text) == f"{SRC}:5: job.model.depth: unknown key"


def test_bad_enum_names_key_line_and_choices() -> None:
    msg = _error("job:\n  model:\n    preset: huge\n")
    assert msg == f"{SRC}:3: job.model.preset: Input should be 'tiny', 'small', 'scout' or 'maverick'"


def test_section_that_is_not_a_mapping() -> None:
    msg = _error("name: demo\njob: 3\n")
    assert msg.startswith(f"{SRC}:2: job: ")


def test_invalid_yaml_syntax_names_line() -> None:
    msg = _error("name: demo\njob:\n  steps: [1, 2\n")
    assert re.match(rf"{re.escape(SRC)}:\d+: not valid YAML: ", msg), msg
    assert "\n" not in msg


def test_tab_indentation_is_a_syntax_error_with_line() -> None:
    assert _error("job:\n\tsteps: 3\n").startswith(f"{SRC}:2: not valid YAML: ")


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("hello\n", "str"), ("3\n", "int")])
def test_non_mapping_top_level(text: str, kind: str) -> None:
    msg = _error(text)
    assert msg.startswith(f"{SRC}: ")
    assert "mapping" in msg
    assert kind in msg


def test_several_problems_are_counted() -> None:
    msg = _error("ray:\n  nodes: 0\n  cpus_per_node: 0\n")
    assert "(and 1 more problem(s))" in msg


# -- cross-field rules --------------------------------------------------------------------


def test_heartbeat_interval_must_be_below_timeout() -> None:
    text = "controller:\n  heartbeat_interval_s: 10\n  heartbeat_timeout_s: 5\n"
    msg = _error(text)
    assert msg.startswith(f"{SRC}")
    assert "controller.heartbeat_interval_s" in msg
    assert "controller.heartbeat_timeout_s" in msg


def test_heartbeat_interval_equal_to_timeout_is_rejected() -> None:
    msg = _error("controller:\n  heartbeat_interval_s: 5\n  heartbeat_timeout_s: 5\n")
    assert "controller.heartbeat_interval_s" in msg


def test_heartbeat_timeout_must_be_below_pg_timeout() -> None:
    msg = _error("controller:\n  heartbeat_timeout_s: 100\njob:\n  pg_timeout_s: 60\n")
    assert "controller.heartbeat_timeout_s" in msg
    assert "job.pg_timeout_s" in msg


def test_ingest_processes_need_a_postgresql_store() -> None:
    msg = _error("controller:\n  ingest_processes: 2\n")   # the default store is SQLite
    assert "controller.ingest_processes: 2 needs a PostgreSQL store" in msg
    assert "sqlite" in msg
    cfg = parse_cluster_yaml("controller:\n  ingest_processes: 2\n  ingest_port: 7000\n"
                             "store:\n  url: postgresql+psycopg://u@127.0.0.1/fleet\n", SRC)
    assert (cfg.controller.ingest_processes, cfg.controller.ingest_port) == (2, 7000)


def test_an_ingest_port_without_ingest_processes_is_rejected() -> None:
    msg = _error("controller:\n  ingest_processes: 0\n  ingest_port: 7000\n")
    assert "controller.ingest_port: set only with controller.ingest_processes other than 0" in msg


@pytest.mark.parametrize(("nodes", "store", "expected"), [
    (2, "postgresql+psycopg://u@127.0.0.1/f", 0),        # examples/local.yaml's 4 ranks
    (512, "postgresql+psycopg://u@127.0.0.1/f", 0),      # 4,096 ranks: one process holds
    (513, "postgresql+psycopg://u@127.0.0.1/f", 2),      # 4,104 ranks
    (2048, "postgresql+psycopg://u@127.0.0.1/f", 3),     # 16,384 ranks
    (4096, "postgresql+psycopg://u@127.0.0.1/f", 5),     # 32,768 ranks
    (2048, "sqlite:///x.db", 0),                         # SQLite has one write lock
])
def test_auto_ingest_processes_follow_the_job_size_and_the_store(nodes: int, store: str, expected: int) -> None:
    text = (f"ray:\n  address: 10.0.0.1:6379\njob:\n  nodes: {nodes}\n  ranks_per_node: 8\n"
            f"store:\n  url: {store}\n")
    cfg = parse_cluster_yaml(text, SRC)
    assert cfg.controller.ingest_processes == "auto"
    assert cfg.ingest_processes() == expected


def test_job_nodes_above_local_ray_nodes_is_rejected() -> None:
    msg = _error("ray:\n  nodes: 2\njob:\n  nodes: 3\n")
    assert "job.nodes (3)" in msg
    assert "ray.nodes (2)" in msg


def test_job_nodes_above_ray_nodes_allowed_with_ray_address() -> None:
    cfg = parse_cluster_yaml("ray:\n  address: 10.0.0.1:6379\n  nodes: 2\njob:\n  nodes: 3\n", SRC)
    assert cfg.job.nodes == 3
    assert cfg.ray.address == "10.0.0.1:6379"


def test_seq_len_above_model_max_seq_len() -> None:
    msg = _error("job:\n  seq_len: 128\n")
    assert msg.startswith(f"{SRC}:2: job: ")
    assert "seq_len (128)" in msg
    assert "max_seq_len (64)" in msg


def test_seq_len_fits_larger_preset() -> None:
    cfg = parse_cluster_yaml("job:\n  seq_len: 128\n  model:\n    preset: small\n", SRC)
    assert cfg.job.train_args().seq_len == 128


def test_model_override_dim_not_divisible_by_heads() -> None:
    msg = _error("job:\n  model:\n    preset: tiny\n    dim: 66\n")
    assert msg.startswith(f"{SRC}:3: job.model: ")
    assert "dim (66)" in msg
    assert "n_heads (4)" in msg


def test_model_override_applies() -> None:
    cfg = parse_cluster_yaml("job:\n  model:\n    dim: 128\n    n_heads: 8\n", SRC)
    args = cfg.job.model.args()
    assert (args.dim, args.n_heads, args.n_kv_heads) == (128, 8, 2)


def test_config_is_frozen() -> None:
    cfg = parse_cluster_yaml("", SRC)
    with pytest.raises(Exception):
        cfg.job.steps = 1  # type: ignore[misc]


# -- YAML constructs whose loader errors are not yaml.YAMLError ---------------------------


def test_invalid_timestamp_is_a_config_error() -> None:
    # PyYAML builds datetime objects for date-like scalars and lets ValueError escape
    msg = _error("name: 2001-02-30\n")
    assert msg.startswith(SRC)


def test_deeply_nested_yaml_is_a_config_error() -> None:
    # PyYAML's composer recurses once per nesting level
    msg = _error("name: " + "[" * 2000 + "]" * 2000 + "\n")
    assert msg.startswith(SRC)


# -- fuzzing ------------------------------------------------------------------------------

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure reproduces
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@FUZZ
@given(st.text())
def test_fuzz_arbitrary_text_only_raises_config_error(text: str) -> None:
    try:
        cfg = parse_cluster_yaml(text, SRC)
    except ConfigError as exc:
        assert str(exc).startswith(SRC)
    else:
        assert isinstance(cfg, ClusterConfig)


def _section_fields(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 16, 64, 65535, 65536]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.1, 1.0, 10.0, 60.0, math.inf, -math.inf, math.nan]),
    st.text(max_size=20),
    st.sampled_from(["tiny", "small", "huge", "", "127.0.0.1:6379", "sqlite:///x.db"]),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def _section(model: type[BaseModel], nested: dict[str, st.SearchStrategy] | None = None):
    keys = _section_fields(model) + ["bogus"]
    value_for = {k: (nested or {}).get(k, _VALUES) for k in keys}
    return st.one_of(
        st.fixed_dictionaries({}, optional={k: value_for[k] for k in keys}),
        _VALUES,  # a section that is not even a mapping
    )


def _cluster_dicts():
    from fleet.controlplane.config import (
        AgentConfig,
        ControllerConfig,
        JobConfig,
        ModelConfig,
        RayConfig,
        StoreConfig,
    )

    model = _section(ModelConfig)
    sections = {
        "ray": _section(RayConfig),
        "controller": _section(ControllerConfig),
        "store": _section(StoreConfig),
        "agent": _section(AgentConfig),
        "job": _section(JobConfig, {"model": model}),
        "name": _VALUES,
        "state_dir": _VALUES,
        "bogus": _VALUES,
    }
    return st.fixed_dictionaries({}, optional=sections)


@FUZZ
@given(_cluster_dicts())
def test_fuzz_structured_only_raises_config_error(data: dict) -> None:
    text = yaml.safe_dump(data, sort_keys=False)
    try:
        cfg = parse_cluster_yaml(text, SRC)
    except ConfigError as exc:
        msg = str(exc)
        assert msg.startswith(SRC), msg
        assert "\n" not in msg, msg
    else:
        assert isinstance(cfg, ClusterConfig)
        c = cfg.controller
        assert c.heartbeat_interval_s < c.heartbeat_timeout_s < cfg.job.pg_timeout_s
        assert cfg.job.seq_len <= cfg.job.model.args().max_seq_len


# -- the README documents the schema --------------------------------------------------------


def _dotted_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_dotted_keys(ann, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys


def test_dotted_keys_cover_the_schema() -> None:
    keys = _dotted_keys(ClusterConfig)
    assert "job.model.preset" in keys
    assert "controller.heartbeat_timeout_s" in keys
    assert "name" in keys
    assert "job.model" not in keys  # sections are walked, not listed


def test_readme_documents_every_cluster_yaml_key() -> None:
    """README.md must name every cluster.yaml key as a dotted key, e.g. `job.model.preset`.

    Fails until README.md exists and documents every field of the schema in
    controlplane/config.py; the message lists the keys that are missing.
    """
    readme = REPO / "README.md"
    assert readme.is_file(), "README.md does not exist; it must document every cluster.yaml key"
    text = readme.read_text(encoding="utf-8")
    missing = []
    for key in _dotted_keys(ClusterConfig):
        backticked = f"`{key}`" in text
        bare = "." in key and re.search(rf"(?<![\w.]){re.escape(key)}(?![\w.])", text)
        if not (backticked or bare):
            missing.append(key)
    assert not missing, f"README.md does not document these cluster.yaml keys: {missing}"


def test_readme_reference_is_generated_from_the_schema() -> None:
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(repo / "scripts" / "gen_config_reference.py"), "--check", str(repo / "README.md")],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("job:\n  nodes: 2\n  ranks_per_node: 3\n  ep_size: 4\n", "ep_size (4) must divide the world size"),
        ("job:\n  data_parallel: hsdp\n  nodes: 2\n  ranks_per_node: 2\n  ep_size: 4\n",
         "ep_size (4) must divide ranks_per_node (2)"),
        ("job:\n  ep_size: 4\n  model:\n    n_experts: 6\n", "ep_size (4) must divide model n_experts (6)"),
        ("job:\n  model:\n    fp8: e4m3\n", "job.model.fp8"),
        ("job:\n  data_parallel: zero3\n", "job.data_parallel"),
        ("job:\n  model:\n    top_k: 9\n", "top_k (9) must be between 1 and n_experts"),
    ],
)
def test_parallelism_and_model_rules(text: str, needle: str) -> None:
    assert needle in _error(text)


def test_model_overrides_and_recipe_reach_the_worker_contract() -> None:
    cfg = parse_cluster_yaml(
        "job:\n  nodes: 2\n  ranks_per_node: 2\n  ep_size: 2\n  grad_accum_steps: 3\n"
        "  activation_checkpointing: true\n  model:\n    preset: tiny\n    fp8: rowwise\n    n_experts: 8\n",
        SRC,
    )
    args, train = cfg.job.model.args(), cfg.job.train_args()
    assert (args.fp8, args.n_experts) == ("rowwise", 8)
    assert (train.ep_size, train.grad_accum_steps, train.activation_checkpointing) == (2, 3, True)


# -- agent buffering, message size, metrics port, TLS ------------------------------------


def test_agent_buffering_and_controller_limits_default_and_parse() -> None:
    cfg = parse_cluster_yaml("", SRC)
    assert (cfg.agent.batch_max_bytes, cfg.agent.memory_max_bytes, cfg.agent.spill_max_bytes) == (
        1 << 20, 64 << 20, 1 << 30)
    assert cfg.controller.max_message_bytes == 16 << 20
    assert cfg.controller.metrics_port == 0
    assert not cfg.controller.tls.enabled
    assert cfg.controller.tls.server_files() is None and cfg.controller.tls.client_files() is None
    cfg = parse_cluster_yaml(
        "agent:\n  batch_max_bytes: 65536\n  memory_max_bytes: 1048576\n  spill_max_bytes: 0\n"
        "controller:\n  max_message_bytes: 2097152\n  metrics_port: 9400\n", SRC)
    assert (cfg.agent.batch_max_bytes, cfg.agent.memory_max_bytes, cfg.agent.spill_max_bytes) == (
        65536, 1 << 20, 0)
    assert (cfg.controller.max_message_bytes, cfg.controller.metrics_port) == (2 << 20, 9400)


def test_spill_dir_defaults_under_state_dir(tmp_path: Path) -> None:
    cfg = parse_cluster_yaml(f"state_dir: {tmp_path}/state\n", SRC)
    assert cfg.agent_spill_dir() == tmp_path / "state" / "spill"
    cfg = parse_cluster_yaml(f"agent:\n  spill_dir: {tmp_path}/elsewhere\n", SRC)
    assert cfg.agent_spill_dir() == tmp_path / "elsewhere"


def test_max_message_bytes_must_leave_room_for_a_batch() -> None:
    msg = _error("agent:\n  batch_max_bytes: 16777216\n  memory_max_bytes: 67108864\n")
    assert "controller.max_message_bytes (16777216)" in msg
    assert "agent.batch_max_bytes (16777216)" in msg
    assert "headroom" in msg


def test_batch_must_fit_in_agent_memory() -> None:
    msg = _error("agent:\n  batch_max_bytes: 2097152\n  memory_max_bytes: 1048576\n"
                 "controller:\n  max_message_bytes: 33554432\n")
    assert msg.startswith(f"{SRC}:2: agent: ")
    assert "batch_max_bytes (2097152) must be <= memory_max_bytes (1048576)" in msg


def test_metrics_port_out_of_range() -> None:
    assert _error("controller:\n  metrics_port: 70000\n").startswith(f"{SRC}:2: controller.metrics_port: ")


_TLS_KEYS = ("ca_cert", "server_cert", "server_key", "client_cert", "client_key")


def _tls_yaml(paths: dict[str, str]) -> str:
    return "controller:\n  tls:\n" + "".join(f"    {k}: {v}\n" for k, v in paths.items())


def test_tls_files_are_resolved_and_offered_to_both_sides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in _TLS_KEYS:
        (tmp_path / f"{k}.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.chdir(tmp_path)   # relative paths are relative to the working directory
    cfg = parse_cluster_yaml(_tls_yaml({k: f"{k}.pem" for k in _TLS_KEYS}), SRC)
    tls = cfg.controller.tls
    assert tls.enabled
    server, client = tls.server_files(), tls.client_files()
    assert server is not None and client is not None
    assert (server.ca_cert, server.cert, server.key) == (
        tmp_path / "ca_cert.pem", tmp_path / "server_cert.pem", tmp_path / "server_key.pem")
    assert (client.ca_cert, client.cert, client.key) == (
        tmp_path / "ca_cert.pem", tmp_path / "client_cert.pem", tmp_path / "client_key.pem")


def test_missing_tls_file_names_the_dotted_field(tmp_path: Path) -> None:
    paths = {k: str(tmp_path / f"{k}.pem") for k in _TLS_KEYS}
    for k in _TLS_KEYS[1:]:
        Path(paths[k]).write_text("x")
    msg = _error(_tls_yaml(paths))
    assert msg.startswith(f"{SRC}:3: controller.tls.ca_cert: "), msg
    assert "ca_cert.pem" in msg and "No such file" in msg


def test_partial_tls_section_names_the_missing_files(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("x")
    msg = _error(_tls_yaml({"ca_cert": str(tmp_path / "ca.pem")}))
    assert msg.startswith(f"{SRC}:3: controller.tls: "), msg
    assert "server_cert, server_key, client_cert, client_key" in msg


def test_tls_file_that_is_a_folder_is_rejected(tmp_path: Path) -> None:
    paths = {k: str(tmp_path / f"{k}.pem") for k in _TLS_KEYS}
    for k in _TLS_KEYS:
        Path(paths[k]).write_text("x")
    paths["client_key"] = str(tmp_path)
    assert f"{SRC}:7: controller.tls.client_key: cannot read" in _error(_tls_yaml(paths))


def test_min_nodes_must_fit_the_job_and_its_expert_parallelism() -> None:
    from fleet.controlplane.config import parse_cluster_yaml
    from fleet.controlplane.errors import ConfigError

    with pytest.raises(ConfigError, match=r"min_nodes \(3\) must be <= nodes \(2\)"):
        parse_cluster_yaml("job: {nodes: 2, min_nodes: 3}")
    with pytest.raises(ConfigError, match="every world size the job may shrink to"):
        parse_cluster_yaml("job: {nodes: 2, ranks_per_node: 1, ep_size: 2, min_nodes: 1}")
    assert parse_cluster_yaml("job: {nodes: 2, ranks_per_node: 2, ep_size: 2, min_nodes: 1}").job.min_nodes == 1


# -- one owner per field ---------------------------------------------------------------------


def test_the_job_section_embeds_the_workers_recipe_definitions() -> None:
    from fleet.controlplane.config import JobConfig
    from fleet.workers.spec import TrainArgs

    owned = TrainArgs.__pydantic_fields__
    job = JobConfig.model_fields
    assert list(owned) == [k for k in job if k in owned]
    for name, info in owned.items():
        assert (job[name].default, job[name].description, job[name].metadata) == (
            info.default, info.description, info.metadata), name
    cfg = parse_cluster_yaml("job: {steps: 12, lr_schedule: constant, async_checkpoint: false}", SRC)
    assert cfg.job.train_args() == TrainArgs(steps=12, lr_schedule="constant", async_checkpoint=False)


def test_model_overrides_are_the_model_fields_made_optional() -> None:
    from fleet.controlplane.config import MODEL_OVERRIDES, ModelConfig
    from fleet.workers.spec import PRESETS, ModelArgs

    owned = ModelArgs.__pydantic_fields__
    for name in MODEL_OVERRIDES:
        field = ModelConfig.model_fields[name]
        assert field.default is None
        assert field.description == f"Override: {owned[name].description}"
    assert ModelConfig(preset="small", n_layers=None).args() == PRESETS["small"]
    assert ModelConfig(preset="small", n_layers=2).args().n_layers == 2


def test_agents_get_one_settings_object_defined_by_the_agent() -> None:
    from fleet.agent.settings import AGENT_SECTION_FIELDS, GEMM_FIELDS, JOB_FIELDS, LINK_FIELDS, AgentSettings
    from fleet.controlplane.config import WORKER_REPORTING_FIELDS, AgentConfig, ControllerConfig, JobConfig, SdcConfig
    from fleet.workers.spec import WorkerSpec, documented_fields

    assert tuple(AgentConfig.model_fields) == AGENT_SECTION_FIELDS + WORKER_REPORTING_FIELDS + ("raw_ingest_max_ranks", "large_job_batch_interval_s", "host")
    worker = documented_fields(WorkerSpec)
    for section, key, name in [(AgentConfig, "report_interval_s", "report_interval_s"),
                               (AgentConfig, "fr_poll_interval_s", "fr_poll_interval_s"),
                               (JobConfig, "pg_timeout_s", "pg_timeout_s"),
                               (JobConfig, "flight_recorder_entries", "fr_buffer_entries")]:
        field = section.model_fields[key]
        assert (field.default, field.description) == (getattr(WorkerSpec, name), worker[name].description), key
    assert set(AgentSettings.model_fields) == \
        set(AGENT_SECTION_FIELDS) | set(LINK_FIELDS) | set(GEMM_FIELDS) | set(JOB_FIELDS)
    for name in GEMM_FIELDS:  # cluster.yaml's sdc section embeds the agent's definition
        assert SdcConfig.model_fields[name].description == AgentSettings.model_fields[name].description
    gemm = parse_cluster_yaml("sdc: {gemm_size: 64, gemm_interval_s: 5}", SRC).agent_settings()
    assert (gemm.gemm_size, gemm.gemm_interval_s) == (64, 5.0)
    for name in LINK_FIELDS:
        assert ControllerConfig.model_fields[name].description == AgentSettings.model_fields[name].description
    cfg = parse_cluster_yaml(
        "state_dir: /tmp/fleet-state\nagent: {batch_max_events: 7}\n"
        "controller: {heartbeat_interval_s: 0.5, max_message_bytes: 2097152}", SRC)
    settings = cfg.agent_settings()
    assert (settings.batch_max_events, settings.heartbeat_interval_s, settings.max_message_bytes,
            settings.spill_dir) == (7, 0.5, 2 << 20, "/tmp/fleet-state/spill")
    with pytest.raises(ValueError, match=r"batch_max_bytes \(1048576\) must be <= memory_max_bytes \(65536\)"):
        AgentSettings(memory_max_bytes=65536)


def test_config_imports_no_agent_runtime_module() -> None:
    code = ("import sys, fleet.controlplane.config; "
            "print(sorted(m for m in sys.modules if m.startswith('fleet.agent.') and m != 'fleet.agent.settings'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("key", ["\n", "a\nb", " padded ", "", "dotted.key"])
def test_an_unknown_key_that_is_not_one_token_is_quoted_on_one_line(key: str) -> None:
    # hypothesis found {'ray': {'\n': None}}: the key went into the message as a raw newline
    msg = _error(yaml.safe_dump({"ray": {key: None}}))
    assert "\n" not in msg and msg.endswith("unknown key"), msg
    assert repr(key) in msg, msg


# -- detector actions and phase timeouts ------------------------------------------------------


def test_detector_actions_default_to_restart_and_phase_timeouts_to_none() -> None:
    from fleet.controlplane.detectors import DETECTOR_KINDS, DetectorAction

    d = parse_cluster_yaml("", SRC).detect
    assert {k: d.action_of(k) for k in DETECTOR_KINDS} == {k: DetectorAction.RESTART for k in DETECTOR_KINDS}
    assert d.phase_timeouts_s == {}


def test_detector_actions_and_phase_timeouts_parse() -> None:
    from fleet.controlplane.detectors import DetectorAction
    from fleet.proto.kinds import IncidentKind

    d = parse_cluster_yaml("detect:\n  hang: {action: observe}\n  straggler:\n    action: quarantine\n"
                           "  phase_timeouts_s: {checkpointing: 600, eval: 300, my_section: 2.5}\n", SRC).detect
    assert d.action_of(IncidentKind.HANG) is DetectorAction.OBSERVE
    assert d.action_of(IncidentKind.STRAGGLER) is DetectorAction.QUARANTINE
    assert d.action_of(IncidentKind.CRASH) is DetectorAction.RESTART  # not a detector's
    assert d.phase_timeouts_s == {"checkpointing": 600.0, "eval": 300.0, "my_section": 2.5}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("detect:\n  hangg:\n    action: observe\n",
         "x.yaml:2: detect: hangg: unknown detector kind; known: hang, desync, straggler"),
        ("detect:\n  crash: {action: observe}\n", "detect: crash: not a detector's incident"),
        ("detect:\n  hang:\n    action: ignore\n",
         "x.yaml:3: detect.hang.action: Input should be 'observe', 'restart' or 'quarantine'"),
        ("detect:\n  hang:\n    actions: observe\n", "x.yaml:3: detect.hang.actions: unknown key"),
        ("detect:\n  loss_spike: {action: quarantine}\n", "detect.loss_spike: action quarantine needs a node"),
        ("detect:\n  hang_floor_s: 5\n  phase_timeouts_s:\n    eval: 2\n",
         "detect.phase_timeouts_s: eval: 2 s is shorter than hang_floor_s (5 s)"),
        ("detect:\n  phase_timeouts_s: {checkpointing: 0.5}\n",
         "detect.phase_timeouts_s: checkpointing: 0.5 s is shorter than hang_floor_s (1 s)"),
        ("detect:\n  phase_timeouts_s: {'my phase': 20}\n", "detect.phase_timeouts_s: phase name 'my phase'"),
        ("detect:\n  phase_timeouts_s: {eval: -1}\n", "detect.phase_timeouts_s.eval: Input should be greater than 0"),
    ],
)
def test_bad_detector_settings_name_the_key(text: str, needle: str) -> None:
    assert needle in _error(text)
