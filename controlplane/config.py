"""cluster.yaml: the typed, validated description of a fleet deployment and its job.

The file is parsed once, here, into a tree of pydantic models; nothing below the CLI
reads raw dicts or ``os.environ``. Every field documents itself (the README's reference
is checked against this schema by a test). A bad file raises ``ConfigError`` naming the
file, the dotted key and, where YAML tells us, the line.

A field has one owner: the component that uses it defines it, and a section embeds that
definition (default, bounds, description) instead of restating it. The job's recipe is
``workers.spec.TrainArgs``'s, the model overrides are ``workers.spec.ModelArgs``'s made
optional, the workers' timeouts and intervals ``workers.spec.WorkerSpec``'s, and the
agent's batching, buffering and link settings ``agent.settings.AgentSettings``'s. The
sections add placement, restarts, detection and the rules that span components. The
``topology`` section is ``controlplane.topology.TopologyConfig``; the node names it lists
are checked here for a local cluster, and by ``TopologyConfig.resolve`` once an attached
cluster's nodes are known (with the lines located here).

Ordering rules checked at construction:
heartbeat_interval_s < heartbeat_timeout_s < job.pg_timeout_s;
agent.batch_max_bytes <= agent.memory_max_bytes, and
agent.batch_max_bytes + 64 KiB <= controller.max_message_bytes.

Relative paths (store, checkpoints, state, spill, TLS files) are relative to the working
directory. TLS files must exist when the file is parsed; they are kept as absolute paths.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictStr, Tag, ValidationError, ValidationInfo, create_model, \
    field_validator, model_validator
from pydantic.fields import FieldInfo

from fleet.agent.settings import AGENT_SECTION_FIELDS, GEMM_FIELDS, AgentSettings, check_batch_fits_memory
from fleet.controlplane import chaos
from fleet.controlplane.addresses import check_host, check_ray_address, is_wildcard
from fleet.controlplane.config_overrides import Override, apply_overrides, blamed
from fleet.controlplane.detectors import DETECTOR_KINDS, DetectorAction
from fleet.controlplane.errors import ConfigError
from fleet.controlplane.sdc import copies_problem
from fleet.controlplane.topology import KeyedError, TopologyConfig, as_keyed, local_node_names
from fleet.proto.contract import MESSAGE_HEADROOM_BYTES
from fleet.proto.kinds import FaultKind, IncidentKind
from fleet.proto.tls import TlsFiles
from fleet.workers.env import LAUNCH_VARS
from fleet.workers.phases import check_name as check_phase_name
from fleet.workers.spec import PRESETS, ModelArgs, TrainArgs, WorkerSpec, documented_fields, snapshots_mode

#: The embedded default, used when ``fleet up`` is given no ``--cluster``.
DEFAULT_CLUSTER_FILE = Path(__file__).resolve().parent.parent / "examples" / "local.yaml"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _owned_fields(owner: type) -> dict[str, FieldInfo]:
    """The field definitions of the component that owns them (a pydantic model, or a
    dataclass of workers/spec.py)."""
    if issubclass(owner, BaseModel):
        return dict(owner.model_fields)
    return documented_fields(owner)


def _field(owner: type, name: str) -> Any:
    """``owner``'s definition of field ``name`` (default, bounds, description), to embed in a
    section instead of restating it."""
    return FieldInfo.merge_field_infos(_owned_fields(owner)[name])


def _embedded(owner: type, names: tuple[str, ...] | None = None, *,
              override_of_preset: bool = False) -> dict[str, Any]:
    """``create_model`` field definitions embedding ``owner``'s fields (all, or ``names``).

    ``override_of_preset``: each field becomes optional, default null (= keep the preset's
    value), described as an override."""
    owned = _owned_fields(owner)
    out: dict[str, Any] = {}
    for name in names or tuple(owned):
        info = owned[name]
        if override_of_preset:
            out[name] = (info.annotation | None, FieldInfo.merge_field_infos(
                info, default=None, description=f"Override: {info.description}"))
        else:
            out[name] = (info.annotation, FieldInfo.merge_field_infos(info))
    return out


def _problem(exc: ValueError) -> str:
    """One line naming what is wrong (a ValidationError's first problem, or the message)."""
    if isinstance(exc, ValidationError):
        return exc.errors()[0]["msg"].removeprefix("Value error, ")
    return str(exc)


class RayConfig(_Section):
    """Where the Ray cluster comes from."""

    address: str | None = Field(
        None,
        description="Address of an existing Ray cluster to attach to: the head's GCS address HOST:PORT that "
        "`ray start --head` prints (e.g. 10.0.0.1:6379), or auto (the cluster this host belongs to). `fleet up` "
        "runs on a node of that cluster; every Ray node gets one agent. Unset: start a local cluster of `nodes` "
        "simulated nodes on 127.0.0.1.",
    )
    nodes: int = Field(2, ge=1, le=16, description="Local mode: simulated nodes (one raylet each).")
    cpus_per_node: int = Field(
        4, ge=1, le=256, description="Local mode: logical CPUs each simulated node offers Ray."
    )
    object_store_mb: int = Field(
        128, ge=64, le=65536, description="Local mode: object store size per node, MiB."
    )

    @field_validator("address")
    @classmethod
    def _gcs_address(cls, value: str | None) -> str | None:
        return None if value is None else check_ray_address(value)


class TlsConfig(_Section):
    """Mutual TLS between the agents/CLI and the controller: all five files, or none (plaintext)."""

    ca_cert: Path | None = Field(
        None, description="PEM CA certificate that signed the server and client certificates "
        "(both sides trust only it). Unset with the others: plaintext, for loopback only. "
        "Relative paths (here and below) are relative to the working directory.",
    )
    server_cert: Path | None = Field(
        None, description="PEM certificate the controller presents; its SAN must name the "
        "controller's address as the agents dial it (e.g. IP:127.0.0.1).",
    )
    server_key: Path | None = Field(None, description="PEM private key of server_cert.")
    client_cert: Path | None = Field(
        None, description="PEM certificate node agents and the CLI present to the controller.",
    )
    client_key: Path | None = Field(None, description="PEM private key of client_cert.")

    @field_validator("*")
    @classmethod
    def _readable_file(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        try:
            with open(value, "rb"):
                pass
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {value} ({getattr(exc, 'strerror', None) or exc})") from None
        return Path(value).resolve()

    @model_validator(mode="after")
    def _all_or_none(self) -> TlsConfig:
        missing = [name for name, value in self if value is None]
        if missing and len(missing) != len(type(self).model_fields):
            raise ValueError(f"TLS needs all five files; missing: {', '.join(missing)}")
        return self

    @property
    def enabled(self) -> bool:
        return self.ca_cert is not None

    def server_files(self) -> TlsFiles | None:
        """What the controller's server presents and verifies; None when TLS is off."""
        if self.ca_cert is None or self.server_cert is None or self.server_key is None:
            return None
        return TlsFiles(ca_cert=self.ca_cert, cert=self.server_cert, key=self.server_key)

    def client_files(self) -> TlsFiles | None:
        """What agents and the CLI present and trust; None when TLS is off."""
        if self.ca_cert is None or self.client_cert is None or self.client_key is None:
            return None
        return TlsFiles(ca_cert=self.ca_cert, cert=self.client_cert, key=self.client_key)


class ControllerConfig(_Section):
    """The controller's gRPC endpoint and liveness timing."""

    host: str = Field(
        "127.0.0.1",
        description="Address the controller's gRPC and metrics servers bind to (an IP or host name; 0.0.0.0 = "
        "every interface). Agents on other hosts must reach it: see advertise_host.",
    )
    advertise_host: str | None = Field(
        None,
        description="Address agents dial to reach the controller (host only; the port is the one bound). Unset: "
        "`host`, or, when that is a wildcard (0.0.0.0, ::), the IP Ray reports for the node `fleet up` runs on. "
        "With TLS the server certificate's SAN must name it.",
    )
    port: int = Field(0, ge=0, le=65535, description="Port for the controller (0 = any free port).")
    heartbeat_interval_s: float = _field(AgentSettings, "heartbeat_interval_s")
    heartbeat_timeout_s: float = Field(
        10.0, gt=0, le=3600,
        description="Silence after which an agent counts as lost (an agent_loss incident; a dead agent is "
        "started again at once, a live but silent one is waited for). Must lie between heartbeat_interval_s "
        "and job.pg_timeout_s.",
    )
    agent_start_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="Seconds to wait for every node agent to connect."
    )
    max_message_bytes: int = _field(AgentSettings, "max_message_bytes")
    metrics: bool = Field(
        True,
        description="Serve the controller's Prometheus metrics (/metrics on `host` at metrics_port; the port is "
        "written to <state_dir>/controller.json and <state_dir>/prometheus/targets.json). false: no endpoint.",
    )
    metrics_port: int = Field(
        0, ge=0, le=65535,
        description="Port of the controller's Prometheus /metrics endpoint on `host` (0 = any free port).",
    )
    metrics_refresh_interval_s: float = Field(
        1.0, gt=0, le=3600,
        description="Seconds between refreshes of the metrics read from the store (jobs, attempts, incidents, "
        "nodes, restarts) and of those fed by ingested batches; a scrape only reads the cached values. ETTR and "
        "lost time (`fleet report`'s) refresh as often, or less often on a job whose report costs more.",
    )
    ingest_processes: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = Field(
        "auto",
        description="Processes that serve the agents' streams (validate, commit, ack) beside the controller, all "
        "on ingest_port; 0: the controller's own process serves them on `port`. One Python process does about "
        "one core's work. auto: none up to 4,096 ranks or on SQLite, else one per 8,192 ranks plus one (16,384 "
        "ranks: 3). A number above 0 needs a PostgreSQL store.",
    )
    ingest_port: int = Field(
        0, ge=0, le=65535,
        description="Port the ingest processes share on `host` (SO_REUSEPORT; 0 = any free port); agents dial "
        "it instead of `port`. Only with ingest_processes > 0.",
    )
    tls: TlsConfig = Field(default_factory=TlsConfig, description="Mutual TLS.")

    @field_validator("host")
    @classmethod
    def _bind_host(cls, value: str) -> str:
        return check_host(value)

    @field_validator("advertise_host")
    @classmethod
    def _dial_host(cls, value: str | None) -> str | None:
        if value is None:
            return None
        check_host(value)
        if is_wildcard(value):
            raise ValueError(f"{value} listens on every interface; give an address agents can dial")
        return value


class StoreConfig(_Section):
    """The SQL store (SQLAlchemy URL)."""

    url: str = Field(
        "sqlite:///.fleet/fleet.db",
        description="SQLAlchemy URL. Relative SQLite paths are relative to the working directory.",
    )


#: ``controller.ingest_processes: auto``: none up to this many ranks, else one per
#: ``AUTO_INGEST_RANKS_PER_PROCESS`` ranks plus one.
AUTO_INGEST_MIN_RANKS = 4096
AUTO_INGEST_RANKS_PER_PROCESS = 8192

#: WorkerSpec fields cluster.yaml keeps in the ``agent:`` section (the worker -> agent channel).
WORKER_REPORTING_FIELDS = ("report_interval_s", "fr_poll_interval_s")

class AgentConfig(create_model(
        "_AgentSection", __base__=_Section, **_embedded(AgentSettings, AGENT_SECTION_FIELDS),
        **_embedded(WorkerSpec, WORKER_REPORTING_FIELDS))):
    """Batching on the agent -> controller stream and the worker -> agent channel.

    The batching and buffering fields are ``fleet.agent.settings.AgentSettings``'s (the
    agent owns them; ``ClusterConfig.agent_settings()`` is the object agents are started
    with), the two reporting intervals ``fleet.workers.spec.WorkerSpec``'s.
    ``raw_ingest_max_ranks`` is the controller's: it decides ``AgentSettings.collective_fronts``
    (and ``large_job_batch_interval_s`` then applies);
    ``host`` is the launcher's (``orchestrator.AgentSet`` binds each agent's worker channel there)."""

    raw_ingest_max_ranks: int = Field(
        512, ge=1, le=1 << 20,
        description="A job with more ranks than this (job.nodes x job.ranks_per_node) sends collective fronts "
        "instead of every collective: agents keep the raw entries (agent.ring_entries per rank and group) and "
        "send them when the controller suspects a hang or desync, so `fleet replay` shows those around it.",
    )
    large_job_batch_interval_s: float = Field(
        1.0, gt=0, le=60,
        description="agent.batch_interval_s of a job that sends collective fronts (more ranks than "
        "agent.raw_ingest_max_ranks), when larger: fewer, fuller batches, so the controller's work per "
        "message does not grow with the number of agents.",
    )
    host: str = Field(
        "127.0.0.1",
        description="Address each node agent's worker channel binds to, on every node (so loopback, a "
        "wildcard or a name every node resolves for itself); only the node's own ranks connect to it.",
    )

    @field_validator("host")
    @classmethod
    def _bind_host(cls, value: str) -> str:
        return check_host(value)

    def sends_fronts(self, world_size: int) -> bool:
        """Whether a job of ``world_size`` ranks sends collective fronts (a large job)."""
        return world_size > self.raw_ingest_max_ranks

    def batch_interval_for(self, world_size: int) -> float:
        """The agents' batch interval for a job of ``world_size`` ranks."""
        if self.sends_fronts(world_size):
            return max(self.batch_interval_s, self.large_job_batch_interval_s)
        return self.batch_interval_s

    @model_validator(mode="after")
    def _batch_fits_memory(self) -> AgentConfig:
        check_batch_fits_memory(self.batch_max_bytes, self.memory_max_bytes)
        return self


#: The model fields cluster.yaml may override (``job.model.<field>``), in the reference's order.
MODEL_OVERRIDES = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "moe_hidden", "n_experts",
    "top_k", "moe_every", "nope_every", "attention_chunk_size", "load_balance", "aux_loss_coef", "fp8",
)


class _ModelPreset(_Section):
    preset: Literal["tiny", "small", "scout", "maverick"] = Field(
        "tiny", description="Model shape preset (`fleet model-info --preset NAME` shows its size)."
    )


class ModelConfig(create_model(
        "_ModelOverrides", __base__=_ModelPreset,
        **_embedded(ModelArgs, MODEL_OVERRIDES, override_of_preset=True))):
    """The model: a named preset (Llama-4-style MoE decoder), optionally with fields overridden.

    The override fields are ``fleet.workers.spec.ModelArgs``'s, optional: null keeps the
    preset's value."""

    def args(self) -> ModelArgs:
        """The ModelArgs this section describes."""
        overrides = {k: v for k, v in self.model_dump(exclude={"preset"}).items() if v is not None}
        return dataclasses.replace(PRESETS[self.preset], **overrides)

    @model_validator(mode="after")
    def _valid_shape(self) -> ModelConfig:
        try:
            self.args()
        except ValueError as exc:
            raise ValueError(_problem(exc)) from None
        return self


_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: The tag of ``job.entrypoint``'s program form; errors name the key without it.
_PROGRAM = "program"


class EntrypointConfig(_Section):
    """A program of yours, run once per rank as torchrun would run it.

    Every rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
    TORCHELASTIC_*, ...) plus FLEET_JOB_ID and FLEET_ATTEMPT."""

    module: StrictStr | None = Field(
        None, description="Run `python -m MODULE` on every rank (dotted name). Set exactly one of module and "
        "script.")
    script: StrictStr | None = Field(
        None, min_length=1, description="Or run `python SCRIPT` on every rank (a path, relative to workdir).")
    args: list[StrictStr] = Field(
        default_factory=list, description="Arguments after the module or script, each a string.")
    env: dict[StrictStr, StrictStr] = Field(
        default_factory=dict, description="Variables added to every rank's environment (fleet's own, such as "
        "RANK, cannot be set here).")
    workdir: StrictStr | None = Field(
        None, description="Working directory of every rank (default: the directory `fleet up` runs in).")
    inherit_env: bool | None = Field(
        None, description="Start every rank with the environment of the `fleet` command, as torchrun does "
        "(default: yes for a local cluster, no when attached with ray.address: then the node's).")
    tee: bool = Field(
        False, description="Also print every rank's output on the terminal, each line prefixed with its rank "
        "(always kept in <state_dir>/logs/<job>/attempt-<n>/rank-<r>.log).")

    @field_validator("module")
    @classmethod
    def _dotted(cls, value: str | None) -> str | None:
        if value is not None and not _MODULE_NAME.match(value):
            raise ValueError(f"{value!r} is not a dotted Python module name")
        return value

    @field_validator("env")
    @classmethod
    def _names(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid environment variable name "
                                 "(letters, digits and _, not starting with a digit)")
            if name in LAUNCH_VARS:
                raise ValueError(f"{name} is set by fleet for every rank; it cannot be set here")
            if "\0" in value:
                raise ValueError(f"{name}: a value cannot contain a NUL character")
        return env

    @model_validator(mode="after")
    def _one_program(self) -> EntrypointConfig:
        if (self.module is None) == (self.script is None):
            raise ValueError("set exactly one of module and script")
        if any("\0" in a for a in self.args):
            raise ValueError("args cannot contain a NUL character")
        return self

    @property
    def target(self) -> str:
        return self.module or self.script or ""


class _JobPlacement(_Section):
    nodes: int = Field(2, ge=1, le=100_000, description="Nodes the worker group spans.")
    ranks_per_node: int = Field(2, ge=1, le=64, description="Worker processes (ranks) per node.")


class JobConfig(create_model("_JobRecipe", __base__=_JobPlacement, **_embedded(TrainArgs))):
    """The training job: placement, recipe, parallelism, checkpoints and restarts.

    The recipe fields (steps .. memory_snapshots) are ``fleet.workers.spec.TrainArgs``'s:
    the worker owns them; this section adds placement, timeouts and restarts, and checks
    the rules that span sections (ep_size against the world size, seq_len against the model)."""

    checkpoint_dir: str = Field(
        ".fleet/checkpoints", description="Checkpoint root; each job writes to <dir>/<job-id>/."
    )
    pg_timeout_s: float = _field(WorkerSpec, "pg_timeout_s")
    flight_recorder_entries: int = _field(WorkerSpec, "fr_buffer_entries")
    max_restarts: int = Field(3, ge=0, le=1000, description="Attempts after the first before giving up.")
    restart_backoff_s: float = Field(
        1.0, ge=0, le=3600,
        description="Pause before a restart that follows attempts failing before their first step, doubling "
        "with each such attempt in a row (capped at 60 s); a restart after an attempt that made progress is "
        "immediate.",
    )
    min_nodes: int = Field(
        0, ge=0, le=100_000,
        description="Shrink data parallelism instead of waiting: with fewer than `nodes` healthy nodes, run on "
        "as many as there are once at least this many are (0 = never shrink; wait for `nodes`). The model's "
        "expert-parallel size must divide every world size it may shrink to.",
    )
    spare_workers_per_node: int = Field(
        1, ge=0, le=64,
        description="Warm worker processes (torch imported) kept idle on every node, so a restart replaces a "
        "dead rank without starting a process. For a job.entrypoint program at least ranks_per_node are kept: "
        "its restart replaces every rank.",
    )
    snapshot_memory_max_mb: float = Field(
        0.0, ge=0, le=1e9,
        description="Budget, MiB of host memory per rank, for in-memory snapshots (job.memory_snapshots): "
        "3 copies of the rank's own state (float32 parameters and AdamW's two moments, its shard when "
        "sharded: the 2 kept and the one being taken) and, with peer copies, 3 of its ward's. A job whose "
        "estimate exceeds it is refused at `fleet up` (0 = no budget).",
    )
    capacity_wait_s: float = Field(
        300.0, ge=0, le=86400,
        description="Longest wait, before an attempt, for enough healthy (not quarantined) nodes; "
        "`fleet release NODE` ends the wait. Then the job fails.",
    )
    stop_timeout_s: float = Field(
        60.0, gt=0, le=3600,
        description="How long `fleet stop` waits for the ranks to leave by themselves: the built-in trainer's "
        "ranks agree on a step, save a checkpoint of it and return; a job.entrypoint program's ranks get "
        "SIGTERM. Ranks still running then are killed, and the job's reason says so.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model shape.")
    entrypoint: Annotated[
        Annotated[Literal["builtin"], Tag("builtin")] | Annotated[EntrypointConfig, Tag(_PROGRAM)],
        Discriminator(lambda v: "builtin" if isinstance(v, str) else _PROGRAM),
    ] = Field(
        "builtin", description="What every rank runs: `builtin` (fleet's Llama-4-style trainer, configured by "
        "the recipe keys of this section), or a program of yours (see job.entrypoint.*), for which the recipe "
        "keys do not apply.")

    @property
    def user_program(self) -> EntrypointConfig | None:
        """The user's entrypoint; None for the built-in trainer."""
        return self.entrypoint if isinstance(self.entrypoint, EntrypointConfig) else None

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def train_args(self) -> TrainArgs:
        """The TrainArgs this section describes."""
        return TrainArgs(**self.model_dump(include=set(_owned_fields(TrainArgs))))

    _snapshots_from_bool = field_validator("memory_snapshots", mode="before")(
        classmethod(lambda cls, v: snapshots_mode(v)))

    def _check_snapshots(self) -> None:
        """Peer copies need a buddy on another node, and every copy must fit the budget."""
        if self.user_program is not None:
            return
        sharded = TrainArgs(data_parallel=self.data_parallel, ep_size=self.ep_size).sharded
        peer = self.memory_snapshots == "peer"
        if peer and sharded and self.nodes == 1 and "memory_snapshots" in self.model_fields_set:
            raise ValueError(
                "memory_snapshots peer keeps a copy of each rank's shard on a buddy rank on another node, and "
                "this job has 1 node (job.nodes): set job.memory_snapshots to local, or use 2+ nodes")
        if self.snapshot_memory_max_mb > 0 and self.memory_snapshots != "off":
            from fleet.workers import buddy, flops  # builds the model on the meta device: only with a budget

            total, _ = flops.param_counts(self.model.args())
            need = buddy.snapshot_memory(total, self.world_size, self.nodes, sharded, peer)
            if need > self.snapshot_memory_max_mb * 2**20:
                copies = "own and peer copies" if peer and sharded and self.nodes > 1 else "own copies"
                raise ValueError(
                    f"memory_snapshots {self.memory_snapshots} needs about {need / 2**20:,.1f} MiB per rank "
                    f"({copies} of {buddy.state_bytes(total, self.world_size, sharded) / 2**20:,.1f} MiB of "
                    f"state), above job.snapshot_memory_max_mb ({self.snapshot_memory_max_mb:g}): raise the "
                    "budget, or set job.memory_snapshots to local or off")

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        if self.user_program is not None:
            recipe = [name for name in (*_owned_fields(TrainArgs), "model") if name in self.model_fields_set]
            if recipe:
                raise ValueError(f"{recipe[0]} is a setting of the built-in trainer; with a job.entrypoint "
                                 "program it does not apply (pass it to your program in entrypoint.args)")
        model = self.model.args()
        if self.seq_len > model.max_seq_len:
            raise ValueError(
                f"seq_len ({self.seq_len}) exceeds the model's max_seq_len ({model.max_seq_len})"
            )
        if self.world_size % self.ep_size:
            raise ValueError(
                f"ep_size ({self.ep_size}) must divide the world size "
                f"(nodes x ranks_per_node = {self.world_size})"
            )
        if self.ep_size > 1 and model.n_experts % self.ep_size:
            raise ValueError(
                f"ep_size ({self.ep_size}) must divide model n_experts ({model.n_experts})"
            )
        if self.data_parallel == "hsdp" and self.ranks_per_node % self.ep_size:
            raise ValueError(
                f"data_parallel hsdp keeps expert-parallel groups inside a node: ep_size ({self.ep_size}) "
                f"must divide ranks_per_node ({self.ranks_per_node})"
            )
        if self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) must be <= nodes ({self.nodes})")
        self._check_snapshots()
        for n in range(max(self.min_nodes, 1), self.nodes):
            if self.min_nodes and (n * self.ranks_per_node) % self.ep_size:
                raise ValueError(
                    f"ep_size ({self.ep_size}) must divide every world size the job may shrink to "
                    f"(min_nodes {self.min_nodes}: {n} x {self.ranks_per_node} ranks)"
                )
        return self


class PolicyConfig(_Section):
    """When the controller takes a node out of placement by itself."""

    quarantine_after_incidents: int = Field(
        2, ge=0, le=1000,
        description="Quarantine a node once this many incidents of `quarantine_kinds` were blamed on it "
        "within `quarantine_window_s` (counted across jobs); 0 = never automatically.",
    )
    quarantine_window_s: float = Field(
        3600.0, gt=0, le=30 * 86400, description="The window those incidents are counted in, seconds.")
    quarantine_kinds: list[IncidentKind] = Field(
        default_factory=lambda: [k for k in IncidentKind if k.counts_for_quarantine],
        description="Incident kinds that count: crash (a rank's process died) and hang (the flight "
        "recorder named a rank that never entered a collective) point at hardware; error and desync "
        "follow the code, not the node.",
    )

    @field_validator("quarantine_kinds", mode="before")
    @classmethod
    def _known_kinds(cls, kinds: Any) -> Any:
        # Before pydantic's own enum check, so the error lists every known kind in one line.
        if isinstance(kinds, list):
            unknown = sorted({str(k) for k in kinds} - set(IncidentKind))
            if unknown:
                known = sorted(k.value for k in IncidentKind)
                raise ValueError(f"unknown incident kind(s) {unknown}; known: {known}")
        return kinds


class ChaosFault(_Section):
    """One scheduled fault: the same fields and rules as `fleet inject-fault`."""

    kind: str = Field(
        description="Fault kind: " + ", ".join(chaos.FAULT_KINDS) + " (`fleet inject-fault --help` describes each)."
    )
    rank: int | None = Field(
        None, ge=0, le=10**6, description="Target rank (for agent kinds and node-down: that rank's node)."
    )
    node: str | None = Field(None, min_length=1, description="Target node, e.g. node-1 (every rank on it).")
    at_step: int = Field(0, ge=0, le=10**9, description="Fire at the first step >= this one (0 = at once).")
    after_s: float = Field(0.0, ge=0, le=30 * 86400, description="Or: fire this many seconds after the job starts.")
    duration_s: float = Field(
        0.0, ge=0, le=30 * 86400,
        description="hang, slow, agent-down, partition, node-down: how long it lasts (0 = indefinitely).",
    )
    delay_s: float = Field(
        0.0, ge=0, le=3600, description=f"slow: extra seconds per step (0 = {chaos.DEFAULT_SLOW_DELAY_S:g})."
    )
    target: str = Field(
        "", description="sdc: what is corrupted, one of " + ", ".join(chaos.SDC_TARGETS) + " (empty = weight).")
    bit: int | None = Field(
        None, description="sdc: flip this bit of one float32 element (0 = lowest mantissa bit, 31 = sign).")
    value_error: float = Field(
        0.0, description="sdc: or multiply one element by 1 + this relative error (e.g. 0.001).")
    persistent: bool = Field(
        False, description="sdc: corrupt on every step from at_step on (a defective unit), not once.")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        problem = chaos.check_kind(kind)
        if problem:
            raise ValueError(problem.removeprefix("kind: "))
        return kind

    @model_validator(mode="after")
    def _valid_order(self) -> ChaosFault:
        problem = chaos.check_order(self.order())
        if problem:
            raise ValueError(problem)
        return self

    def order(self) -> chaos.FaultOrder:
        """This fault as an order (rank -1 / node "" where unset)."""
        return chaos.FaultOrder(
            kind=self.kind, rank=-1 if self.rank is None else self.rank, node=self.node or "",
            at_step=self.at_step, after_s=self.after_s, duration_s=self.duration_s, delay_s=self.delay_s,
            target=self.target, bit=self.bit, value_error=self.value_error, persistent=self.persistent,
        )


class ChaosConfig(_Section):
    """Faults injected on a schedule while the job runs (chaos testing)."""

    faults: list[ChaosFault] = Field(
        default=[],
        description="Faults to inject, each a mapping of kind, rank or node, at_step or after_s, duration_s "
        "and delay_s (sdc: target, bit or value_error, persistent), as the flags of `fleet inject-fault` "
        "(e.g. `{kind: crash, rank: 1, at_step: 40}`, `{kind: sdc, rank: 1, bit: 30, at_step: 25}`).",
    )

    def orders(self) -> list[chaos.FaultOrder]:
        """The faults as orders for ``chaos.Scheduler``, in file order."""
        return [f.order() for f in self.faults]


class DetectorSettings(_Section):
    """What the controller does when this detector fires."""

    action: DetectorAction = Field(
        DetectorAction.RESTART,
        description="observe: store the incident, its evidence and what `restart` would have done "
        "(`fleet report` shows \"would restart ...\", \"would quarantine node-1 ...\"), and nothing else: "
        "no restart, no quarantine, not counted towards `policy.quarantine_after_incidents`; "
        "restart: as without this key (hang, desync, nan end the attempt and restart it; straggler, "
        "loss_spike, agent_loss, sdc are recorded and the attempt goes on; each counts towards "
        "quarantining its node); quarantine: quarantine the incident's node at once and restart the "
        "attempt off it. An attempt whose ranks fail by themselves is restarted whatever this says.",
    )


class SlowCommSettings(DetectorSettings):
    """The slow_comm detector: a process group whose collectives move data well below what
    its links allow, or whose members persistently arrive late (``controlplane.collective_perf``).
    Judged over each group's newest ``window`` collectives with a measured duration on every
    member (gloo: the ones fleet's wrappers time; NCCL: with TORCH_NCCL_ENABLE_TIMING=1)."""

    min_utilization: float = Field(
        0.5, ge=0, le=1,
        description="Flag a group whose median bus bandwidth is below this fraction of the slowest link on "
        "its path (`topology`); 0 = off. Needs link bandwidths in `topology`: without them utilization is "
        "not known and only skew is judged.",
    )
    min_bytes: int = Field(
        1 << 20, ge=0, le=1 << 40,
        description="Utilization is judged on collectives of at least this many bytes (S as nccl-tests "
        "counts it): a small message's bus bandwidth is its latency, far below a healthy link's bandwidth. "
        "A window rates utilization when a quarter of it is measured collectives this large.",
    )
    skew_s: float = Field(
        0.1, gt=0, le=3600,
        description="A collective whose arrival skew (first to last member entering it) is at least this many "
        "seconds is skewed; a group whose window holds at least 4 skewed collectives with one member last in "
        "at least late_share of them has a late rank (a rank late once per step skews that step's first "
        "collective of each group; the others then wait in it).",
    )
    late_share: float = Field(
        0.8, gt=0, le=1,
        description="Share of the window's skewed collectives one member must enter last to be blamed.",
    )
    window: int = Field(
        128, ge=4, le=100_000, description="Newest collectives per group judged together (several steps' worth).")


def _detector(kind: str, what: str) -> Any:
    return Field(default_factory=DetectorSettings, description=f"The {kind} detector: {what}.")


class DetectConfig(_Section):
    """Live failure detection while an attempt runs (the controller's watchdog)."""

    interval_s: float = Field(0.2, gt=0, le=60, description="Seconds between the watchdog's checks.")
    hang_factor: float = Field(
        3.0, ge=1, le=1000,
        description="Hang threshold: this many times the median recent step time (or hang_floor_s, if "
        "longer). Once no rank has finished a step for that long (telemetry latency allowed for), the "
        "flight recorder is asked which rank the others wait for; only waits older than the threshold count.",
    )
    hang_floor_s: float = Field(1.0, gt=0, le=86400, description="Shortest hang threshold, seconds.")
    unconfirmed_hang_s: float = Field(
        10.0, gt=0, le=86400,
        description="Seconds past the hang threshold after which a stall is a hang even when the flight "
        "recorder names no culprit; the rank that progressed least recently is blamed (none if no rank "
        "stands out).",
    )
    startup_timeout_s: float = Field(
        300.0, gt=0, le=86400,
        description="An attempt that has finished no step this many seconds after it started is hung "
        "(covers process-group setup, restore and the first step).",
    )
    straggler_lag_s: float = Field(
        0.2, gt=0, le=3600,
        description="A rank entering a step's collectives this many seconds after the median other member "
        "is that step's laggard.",
    )
    straggler_steps: int = Field(
        10, ge=1, le=100_000,
        description="The same rank being the laggard in this many consecutive steps makes it a straggler "
        "(one incident per attempt and rank).",
    )
    loss_spike_factor: float = Field(
        5.0, ge=0, le=1e6,
        description="A finite loss above this many times the median of the previous loss_window finite "
        "losses is a loss_spike incident, once per attempt (0 = off).",
    )
    loss_window: int = Field(
        20, ge=1, le=100_000,
        description="Finite losses the spike median is taken over; no spike is called before there are this many.",
    )

    phase_timeouts_s: dict[str, Annotated[float, Field(gt=0, le=30 * 86400)]] = Field(
        default_factory=dict,
        description="Hang threshold, seconds, while a rank is in a named phase, e.g. `{checkpointing: 600, "
        "eval: 300, my_section: 120}`: `checkpointing` is the built-in trainer's checkpoint saves and "
        "commits, other names are a program's own `with fleet.phase(\"eval\"):` blocks. While any rank is "
        "in such a phase the longest of their timeouts replaces the step-based threshold (never shortens "
        "it); outside a named phase, or in one not listed, the usual threshold applies. Each must be "
        ">= hang_floor_s.",
    )
    hang: DetectorSettings = _detector("hang", "no rank progressed past the hang threshold (or the start-up "
                                       "timeout), confirmed by the flight recorder")
    desync: DetectorSettings = _detector("desync", "ranks stalled in different collectives")
    straggler: DetectorSettings = _detector("straggler", "the same rank entered collectives last, step after step")
    nan: DetectorSettings = _detector("nan", "a program's reported loss is not finite (the built-in trainer "
                                      "raises on one itself)")
    loss_spike: DetectorSettings = _detector("loss_spike", "a loss far above its recent median (names no node: "
                                             "quarantine is refused)")
    agent_loss: DetectorSettings = _detector("agent_loss", "a node's agent silent past "
                                             "controller.heartbeat_timeout_s")
    sdc: DetectorSettings = _detector("sdc", "a transient or ambiguous silent-data-corruption verdict")
    slow_comm: SlowCommSettings = Field(
        default_factory=SlowCommSettings,
        description="The slow_comm detector: a group's collectives below `min_utilization` of its slowest "
        "link, or a member persistently last (`skew_s`); names the likely cause (a late rank, a slow node, "
        "a cross-rack group). Recorded; the attempt goes on.")

    @model_validator(mode="before")
    @classmethod
    def _known_detectors(cls, data: Any) -> Any:
        # A mapping under an unknown key is a detector section: say which kinds exist.
        if isinstance(data, dict):
            known = ", ".join(DETECTOR_KINDS)
            for key, value in data.items():
                if key in cls.model_fields or not isinstance(value, dict):
                    continue
                if key in set(IncidentKind):
                    raise ValueError(f"{key}: not a detector's incident (the ranks or the "
                                     f"controller end the attempt with it themselves); detectors: {known}")
                raise ValueError(f"{_key_text(key)}: unknown detector kind; known: {known}")
        return data

    @field_validator("loss_spike")
    @classmethod
    def _spike_has_no_node(cls, settings: DetectorSettings) -> DetectorSettings:
        if settings.action is DetectorAction.QUARANTINE:
            raise ValueError("action quarantine needs a node, and a loss spike names none (the loss is the "
                             "global mean); use observe or restart")
        return settings

    @field_validator("phase_timeouts_s")
    @classmethod
    def _phases_above_floor(cls, timeouts: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        floor = info.data.get("hang_floor_s")
        for name, timeout in timeouts.items():
            try:
                check_phase_name(name)
            except ValueError as exc:
                raise ValueError(str(exc)) from None
            if floor is not None and timeout < floor:
                raise ValueError(f"{name}: {timeout:g} s is shorter than hang_floor_s ({floor:g} s), the hang "
                                 "threshold it replaces during the phase")
        return timeouts

    def action_of(self, kind: IncidentKind) -> DetectorAction:
        """``detect.<kind>.action`` (``restart`` for a kind that is not a detector's)."""
        settings = getattr(self, kind.value, None) if kind in DETECTOR_KINDS else None
        return settings.action if settings is not None else DetectorAction.RESTART

    @model_validator(mode="after")
    def _interval_below_floor(self) -> DetectConfig:
        if not self.interval_s < self.hang_floor_s:
            raise ValueError("interval_s must be < hang_floor_s (a check per threshold at least)")
        return self


class SdcConfig(_Section):
    """Silent-data-corruption checks: fingerprints compared across copies, triggers, node GEMM tests."""

    check_interval: int = Field(
        10, ge=0, le=1_000_000,
        description="Every this many steps each rank fingerprints its parameters and optimizer state "
        "(bitwise) and the copies that must be identical are compared, on the step's own all-reduce "
        "(0 = off). Needs copies: data_parallel ddp or hsdp on 2+ nodes. Left unset, checks are simply off "
        "where there is no copy (fsdp shards everything once; a 1-rank world; hsdp on 1 node); set "
        "explicitly there, it is an error.",
    )
    trigger_factor: float = Field(
        10.0, ge=0, le=1e6,
        description="A gradient norm, loss or update size this many times its running median forces a "
        "fingerprint check at once, whatever the interval (0 = no triggers).",
    )
    # the agent's, which runs the test (agent.gemm_check)
    gemm_size: int = _field(AgentSettings, "gemm_size")
    gemm_interval_s: float = _field(AgentSettings, "gemm_interval_s")
    preflight: bool = Field(
        True, description="Run the known-answer GEMM test on every node before an attempt is placed on "
        "it; a node that fails is quarantined and not used.",
    )


class ClusterConfig(_Section):
    """Top level of cluster.yaml."""

    name: str = Field("fleet-job", min_length=1, max_length=128, description="Job name.")
    state_dir: str = Field(
        ".fleet", description="Folder for the token, controller address file and logs."
    )
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray cluster.")
    controller: ControllerConfig = Field(default_factory=ControllerConfig, description="Controller.")
    store: StoreConfig = Field(default_factory=StoreConfig, description="SQL store.")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="Node agents.")
    job: JobConfig = Field(default_factory=JobConfig, description="The training job.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="Automatic quarantine.")
    chaos: ChaosConfig = Field(default_factory=ChaosConfig, description="Scheduled fault injection.")
    sdc: SdcConfig = Field(
        default_factory=SdcConfig,
        description="Silent-data-corruption checks (fingerprints, triggers, known-answer GEMM tests).")
    detect: DetectConfig = Field(
        default_factory=DetectConfig, description="Live failure detection (hangs, stragglers, loss spikes, agent loss)."
    )
    topology: TopologyConfig | None = Field(
        None, description="The network: link bandwidths (Gbit/s) and racks. Placement keeps the groups that "
        "talk most inside a node, then a rack; the slow_comm detector rates collectives against the slowest "
        "link. Unset: no topology (nodes are taken in name order).")

    @model_validator(mode="after")
    def _ordering(self) -> ClusterConfig:
        c = self.controller
        if not c.heartbeat_interval_s < c.heartbeat_timeout_s:
            raise ValueError(
                "controller.heartbeat_interval_s must be < controller.heartbeat_timeout_s"
            )
        if not c.heartbeat_timeout_s < self.job.pg_timeout_s:
            raise ValueError("controller.heartbeat_timeout_s must be < job.pg_timeout_s")
        if self.agent.batch_max_bytes + MESSAGE_HEADROOM_BYTES > c.max_message_bytes:
            raise ValueError(
                f"controller.max_message_bytes ({c.max_message_bytes}) must exceed agent.batch_max_bytes "
                f"({self.agent.batch_max_bytes}) by at least {MESSAGE_HEADROOM_BYTES} bytes of headroom"
            )
        if c.ingest_processes not in (0, "auto") and not self.store.url.startswith("postgresql"):
            raise ValueError(f"controller.ingest_processes: {c.ingest_processes} needs a PostgreSQL store "
                             f"(store.url is {self.store.url.split(':', 1)[0]}:...; SQLite has one write lock)")
        if c.ingest_port and c.ingest_processes == 0:
            raise ValueError("controller.ingest_port: set only with controller.ingest_processes other than 0")
        if self.ray.address is None and self.job.nodes > self.ray.nodes:
            raise ValueError(
                f"job.nodes ({self.job.nodes}) exceeds the local cluster's ray.nodes "
                f"({self.ray.nodes})"
            )
        return self

    @model_validator(mode="after")
    def _topology_nodes_exist(self) -> ClusterConfig:
        # A local cluster's node names are known now; an attached one's once Ray is up
        # (``TopologyConfig.resolve``, with the lines ``validate_cluster_data`` located).
        if self.topology is not None and self.ray.address is None:
            found = self.topology.unknown_node(local_node_names(self.ray.nodes))
            if found is not None:
                raise KeyedError(("topology", *found[0]), found[1])
        return self

    @model_validator(mode="after")
    def _sdc_has_copies(self) -> ClusterConfig:
        """SDC checks and sdc faults need a copy of the state to compare (``controlplane.sdc``)."""
        job = self.job
        problem = copies_problem(job.data_parallel, job.world_size, job.nodes, job.user_program is not None)
        if problem is None:
            return self
        layout = f"job: {job.nodes} node(s) x {job.ranks_per_node} rank(s)"
        if "check_interval" in self.sdc.model_fields_set and self.sdc.check_interval > 0:
            raise ValueError(f"sdc.check_interval: {self.sdc.check_interval} asks for fingerprint checks, but "
                             f"{problem} ({layout}); set it to 0, or leave it out")
        for i, fault in enumerate(self.chaos.faults):
            if fault.kind == FaultKind.SDC:
                raise ValueError(f"chaos.faults.{i}.kind: sdc needs a copy of the corrupted state to compare, "
                                 f"but {problem} ({layout})")
        return self


    def ingest_processes(self) -> int:
        """How many ingest processes serve the agents (``controller.ingest_processes``,
        ``auto`` resolved for this job and store)."""
        n = self.controller.ingest_processes
        if n != "auto":
            return n
        if self.job.world_size <= AUTO_INGEST_MIN_RANKS or not self.store.url.startswith("postgresql"):
            return 0
        return -(-self.job.world_size // AUTO_INGEST_RANKS_PER_PROCESS) + 1

    def agent_spill_dir(self) -> Path:
        """Absolute folder agents spill to (``agent.spill_dir``, else ``<state_dir>/spill``)."""
        return Path(self.agent.spill_dir or Path(self.state_dir) / "spill").resolve()

    def agent_settings(self) -> AgentSettings:
        """The one object every node agent is started with: the ``agent`` section, its spill
        folder resolved, the controller's heartbeat interval and message limit, the
        known-answer GEMM test's size and interval (``sdc``), and ``collective_fronts`` for a
        job of more than ``agent.raw_ingest_max_ranks`` ranks (whose batch interval is then
        at least ``agent.large_job_batch_interval_s``)."""
        c, a = self.controller, self.agent
        return AgentSettings(**{
            **a.model_dump(include=set(AGENT_SECTION_FIELDS)),
            **self.sdc.model_dump(include=set(GEMM_FIELDS)),
            "spill_dir": str(self.agent_spill_dir()),
            "heartbeat_interval_s": c.heartbeat_interval_s,
            "max_message_bytes": c.max_message_bytes,
            "collective_fronts": a.sends_fronts(self.job.world_size),
            "batch_interval_s": a.batch_interval_for(self.job.world_size),
        })


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at ``loc`` (or of its nearest existing parent)."""
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            match = next((v for k, v in node.value if getattr(k, "value", None) == key), None)
            if match is None:
                # an unknown key: point at the key itself when it exists
                keyed = next((k for k, _ in node.value if getattr(k, "value", None) == key), None)
                return keyed.start_mark.line + 1 if keyed is not None else line
            node = match
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            break
        line = node.start_mark.line + 1
    return line


def _key_text(part: Any) -> str:
    """One part of a dotted key as an error shows it: quoted when it would not read as
    one token on one line (an empty key, spaces at its ends, a newline, a dot)."""
    text = str(part)
    if isinstance(part, str) and (not text or not text.isprintable() or text.strip() != text or "." in text):
        return repr(text)
    return text


#: What to do about a bad cluster.yaml (or override of it).
_FILE_HINT = "`fleet config schema` describes every key; `fleet config show` prints the file as fleet reads it"


def parse_cluster_yaml(text: str, source: str = "<string>", overrides: Sequence[Override] = ()) -> ClusterConfig:
    """Parse and validate cluster.yaml text; ``source`` names the file in errors.
    ``overrides`` (``config_overrides``) are set on the parsed mapping before validation."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}{where}: not valid YAML: {problem}", hint=_FILE_HINT) from None
    except ValueError as exc:  # e.g. an impossible date, which PyYAML turns into a datetime
        raise ConfigError(f"{source}: not valid YAML: {exc}", hint=_FILE_HINT) from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply", hint=_FILE_HINT) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, not {type(data).__name__}",
                          hint=_FILE_HINT)
    return validate_cluster_data(data, source, overrides=overrides, root=root)


def validate_cluster_data(data: dict[str, Any], source: str, *, overrides: Sequence[Override] = (),
                          root: yaml.Node | None = None) -> ClusterConfig:
    """Validate cluster.yaml's parsed mapping, ``overrides`` set on it first. A problem is
    one ``ConfigError``: ``<source>[:line]: <dotted key>: <problem>``, or, when an override
    is to blame, ``<override>: <dotted key>: <problem>``. ``root``: the file's YAML node
    tree, for line numbers."""
    if overrides:
        data = apply_overrides(data, overrides)
    try:
        cfg = ClusterConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        # a validator may name a key below its own (``topology.KeyedError``)
        full = (*err["loc"], *as_keyed(err.get("ctx", {}).get("error")))
        loc = tuple(p for i, p in enumerate(full)
                    if not (isinstance(p, str) and p.startswith("function-"))
                    and not (i and full[i - 1] == "entrypoint" and p in (_PROGRAM, "builtin")))
        key = ".".join(_key_text(p) for p in loc)
        msg = " ".join(err["msg"].removeprefix("Value error, ").splitlines())
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        more = f" (and {len(exc.errors()) - 1} more problem(s))" if len(exc.errors()) > 1 else ""
        where = _where(source, root, overrides, loc, msg, unknown_key=err["type"] == "extra_forbidden")
        prefix = f"{where}: {key}: " if key else f"{where}: "
        raise ConfigError(f"{prefix}{msg}{more}", hint=_FILE_HINT) from None
    if cfg.topology is not None:  # for the node names an attached cluster checks once Ray is up
        cfg.topology.locate(lambda loc: _where(source, root, overrides, ("topology", *loc), ""))
    return cfg


def _where(source: str, root: yaml.Node | None, overrides: Sequence[Override], loc: tuple[Any, ...],
           msg: str, unknown_key: bool = False) -> str:
    """Where a problem at ``loc`` with message ``msg`` comes from: ``<source>[:line]``, or the
    override to blame (``config_overrides.blamed``)."""
    culprit, alone = blamed(overrides, loc, msg, unknown_key=unknown_key)
    if culprit is not None and alone:
        return culprit.source
    line = _line_of(root, loc) if loc and root is not None else None
    where = f"{source}:{line}" if line else source
    if culprit is not None:  # a section's own rule, over the file's values and the override's
        where += f" with {culprit.source}"
    elif overrides and not loc:  # a rule across sections: the file, or what was set on it
        where += f" with {', '.join(o.source for o in overrides)}"
    return where


def load_cluster_config(path: str | Path, overrides: Sequence[Override] = ()) -> ClusterConfig:
    """Read, parse and validate a cluster.yaml file, ``overrides`` (``--set``) set on it
    before validation."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file", hint="--cluster (or FLEET_CLUSTER) names the file; "
                          "without either fleet runs examples/local.yaml") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    return parse_cluster_yaml(text, source=str(path), overrides=overrides)

