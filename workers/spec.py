"""What a worker is told to do: the model shape, the training recipe, and its place in the job.

The worker owns these definitions: every field of ``ModelArgs`` and ``TrainArgs`` is
defined here once, with its type, default, bounds and description. cluster.yaml's
``job:`` section (``controlplane/config.py``) and the torchrun flags of
``workers/train.py`` are derived from these fields instead of restating them.

``ModelArgs`` and ``TrainArgs`` are frozen pydantic dataclasses: constructing one
validates it (bounds, choices, the model's shape rules) and raises a ``ValueError``
(pydantic's ``ValidationError``) naming the problem; ``dataclasses.replace`` works and
re-validates. ``WorkerSpec`` is a plain frozen dataclass of values the launcher fills
in; its timeouts and intervals carry their definitions in field metadata
(``documented_fields``), which cluster.yaml and the flags embed the same way. All of
them hold only plain values so they pickle across Ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator
from pydantic.fields import FieldInfo
from pydantic.dataclasses import dataclass as validated_dataclass

_VALIDATED = ConfigDict(allow_inf_nan=False)


@validated_dataclass(frozen=True, config=_VALIDATED)
class ModelArgs:
    """Shape of the Llama-4-style decoder (see workers/model.py).

    Layer i is a NoPE layer (no rotary embedding, attention temperature tuning) when
    ``nope_every`` and ``(i + 1) % nope_every == 0``, as in Hugging Face's Llama 4
    config; the others use RoPE (optionally chunked local attention). Layer i is a MoE
    layer when ``n_experts`` and ``(i + 1) % moe_every == 0`` (Scout: every layer,
    Maverick: every second); the others have a dense SwiGLU of width ``ffn_hidden``.
    """

    vocab_size: int = Field(256, ge=8, le=4_000_000, description="vocabulary size.")
    dim: int = Field(64, ge=8, le=65536, description="model width.")
    n_layers: int = Field(4, ge=1, le=1024, description="decoder blocks.")
    n_heads: int = Field(4, ge=1, le=1024, description="attention heads.")
    n_kv_heads: int = Field(2, ge=1, le=1024, description="key/value heads (GQA).")
    head_dim: int = Field(0, ge=0, description="per-head width (0 = dim // n_heads).")
    ffn_hidden: int = Field(172, ge=1, description="dense layers' SwiGLU width.")  # HF: intermediate_size_mlp
    max_seq_len: int = Field(64, ge=1, description="longest sequence the model is built for, tokens.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    # iRoPE
    nope_every: int = Field(
        4, ge=0, description="every Nth layer has no positional encoding (iRoPE; 0 = none).")
    attn_temperature_tuning: bool = Field(True, description="NoPE layers scale queries with position.")
    attn_floor_scale: float = Field(8192.0, gt=0, description="temperature tuning: positions per scale step.")
    attn_scale: float = Field(0.1, ge=0, description="temperature tuning: scale growth per step.")
    attention_chunk_size: int = Field(
        0, ge=0, description="chunked local attention on RoPE layers (0 = off).")
    # mixture of experts
    n_experts: int = Field(4, ge=0, le=4096, description="routed experts per MoE layer (0 = dense).")
    top_k: int = Field(1, ge=1, description="experts each token is routed to.")
    n_shared_experts: int = Field(1, ge=0, description="always-active shared experts per MoE layer.")
    moe_hidden: int = Field(128, ge=1, description="each expert's SwiGLU width.")  # the shared expert's too
    moe_every: int = Field(2, ge=1, description="every Nth layer is MoE (1 = all).")
    load_balance: Literal["aux_loss", "bias"] = Field(
        "aux_loss", description="MoE balancing, auxiliary loss or loss-free router bias.")
    aux_loss_coef: float = Field(0.01, ge=0, le=10, description="weight of the router auxiliary loss.")
    # numerics
    fp8: Literal["off", "tensorwise", "rowwise"] = Field(
        "off", description="FP8 compute for attention and expert linears, and its scaling.")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and (i + 1) % self.moe_every == 0

    def is_nope_layer(self, i: int) -> bool:
        return self.nope_every > 0 and (i + 1) % self.nope_every == 0

    def __post_init__(self) -> None:
        if not self.head_dim and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_size % 2:
            raise ValueError("head dimension must be even for RoPE")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and n_experts ({self.n_experts})")


def snapshots_mode(value: Any) -> Any:
    """``memory_snapshots`` as a mode: true is ``peer``, false ``off``."""
    return {True: "peer", False: "off"}[value] if isinstance(value, bool) else value


#: Named model shapes. ``tiny`` trains at several steps/s with 4 ranks on 2 CPU cores;
#: ``small`` is GPU-sized; ``scout`` and ``maverick`` are Llama 4's real shapes
#: (Hugging Face Llama4TextConfig of Llama-4-Scout-17B-16E / Maverick-17B-128E).
PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(),
    "small": ModelArgs(
        vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4,
        ffn_hidden=4096, moe_hidden=2048, n_experts=8, moe_every=2, max_seq_len=2048,
        rope_theta=500000.0,
    ),
    "scout": ModelArgs(
        vocab_size=202048, dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim=128,
        ffn_hidden=16384, moe_hidden=8192, n_experts=16, top_k=1, n_shared_experts=1,
        moe_every=1, max_seq_len=8192, rope_theta=500000.0, attention_chunk_size=8192,
    ),
    "maverick": ModelArgs(
        vocab_size=202048, dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim=128,
        ffn_hidden=16384, moe_hidden=8192, n_experts=128, top_k=1, n_shared_experts=1,
        moe_every=2, max_seq_len=8192, rope_theta=500000.0, attention_chunk_size=8192,
    ),
}


@validated_dataclass(frozen=True, config=_VALIDATED)
class TrainArgs:
    """The training recipe shared by every rank.

    Parallelism: world = dp x ep ranks; experts are sharded over ep, dense parameters
    over dp x ep. Data: packed documents from a synthetic stream, or a memory-mapped
    token file.
    """

    steps: int = Field(300, ge=1, le=10**9, description="Training (optimizer) steps to complete.")
    batch_size: int = Field(4, ge=1, le=1_000_000, description="Sequences per rank per micro-batch.")
    seq_len: int = Field(64, ge=2, le=1_048_576, description="Tokens per sequence.")
    lr: float = Field(3e-3, gt=0, le=10, description="Peak AdamW learning rate.")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of model init and the synthetic data stream.")
    grad_accum_steps: int = Field(1, ge=1, le=4096, description="Micro-batches per optimizer step.")
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="Clip the global gradient norm to this (0 = off).")
    warmup_steps: int = Field(10, ge=0, description="Linear learning-rate warm-up steps.")
    lr_schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="After warm-up: cosine decay to min_lr_ratio x lr, or constant."
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Final learning rate of the cosine schedule, as a fraction of lr.")
    weight_decay: float = Field(0.0, ge=0, le=10, description="AdamW weight decay.")
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder block in the backward pass (saves memory)."
    )
    ep_size: int = Field(
        1, ge=1, description="Expert-parallel ranks: MoE experts are sharded over groups of this many ranks."
    )
    data_parallel: Literal["fsdp", "ddp", "hsdp"] = Field(
        "fsdp", description="How dense parameters are data-parallel: FSDP2 fully_shard over all ranks, DDP, "
        "or hsdp (FSDP2 sharded inside a node and replicated across nodes: every shard has a copy on each "
        "other node, which SDC fingerprints compare)."
    )
    dataset: str = Field(
        "synthetic", min_length=1,
        description="`synthetic` (packed documents, deterministic per step and rank) or the path of a flat "
        "token file.",
    )
    mean_doc_len: int = Field(24, ge=2, description="Synthetic data: mean document length, tokens.")
    checkpoint_interval: int = Field(50, ge=0, description="Steps between checkpoints (0 = none).")
    async_checkpoint: bool = Field(
        True, description="Write checkpoints in the background; training waits only for the copy."
    )
    keep_checkpoints: int = Field(3, ge=1, description="Newest valid checkpoints kept on disk.")
    memory_snapshots: Literal["off", "local", "peer"] = Field(
        "peer", description="Copy the training state to memory after every step, so a restart loses at most "
        "the step in flight. `local`: each rank keeps its own copy; replicated (DDP) state comes from any "
        "surviving rank, sharded state only while every rank survives. `peer` (the default): sharded state "
        "(FSDP, expert shards) also has a copy on a buddy rank on another node, so a lost rank or node is "
        "restored from memory too (on one node, where there is no other node, `peer` is `local`). `off`: "
        "none. Without a copy in memory, the newest valid checkpoint on disk is used. true means peer, false off.",
    )

    _snapshots_from_bool = field_validator("memory_snapshots", mode="before")(
        classmethod(lambda cls, v: snapshots_mode(v)))

    @property
    def sharded(self) -> bool:
        """Whether ranks hold different state (anything but DDP without expert parallelism)."""
        return not (self.data_parallel == "ddp" and self.ep_size == 1)


def _documented(default: int | float, description: str, **bounds: float) -> Any:
    """A plain field with a default whose definition (description, bounds) travels in its
    metadata under ``DEFINITION``, for cluster.yaml and the torchrun flags to embed."""
    definition = FieldInfo.from_annotated_attribute(type(default), Field(default, description=description, **bounds))
    return field(default=default, metadata={DEFINITION: definition})


#: The metadata key of a documented ``WorkerSpec`` field's pydantic definition.
DEFINITION = "fleet.definition"


def documented_fields(cls: type) -> dict[str, FieldInfo]:
    """The fields of ``cls`` with a definition: all of a validated dataclass's, or a plain
    dataclass's documented ones (``WorkerSpec``'s timeouts and intervals)."""
    owned = getattr(cls, "__pydantic_fields__", None)
    if owned is not None:
        return dict(owned)
    return {f.name: f.metadata[DEFINITION] for f in dataclasses.fields(cls) if DEFINITION in f.metadata}


@dataclass(frozen=True)
class Launch:
    """A user program run once per rank as torchrun would run it (``job.entrypoint``).

    Exactly one of ``module`` (``python -m module``) and ``script`` (``python script``)
    is set. ``env`` is the program's base environment (the launcher's, when inherited,
    then ``entrypoint.env``): the warm interpreter is started with it, and the per-rank
    torchrun variables are added at launch (``fleet.workers.env.launch_env``)."""

    module: str = ""
    script: str = ""
    args: tuple[str, ...] = ()
    workdir: str = ""
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str = ""            # <state_dir>/logs/<job>/attempt-<n>: rank-<r>.log lands here
    tee: bool = False            # also copy each line to the controller's terminal, rank-prefixed

    @property
    def target(self) -> str:
        return self.module or self.script

    def log_path(self, rank: int) -> str:
        return f"{self.log_dir}/rank-{rank}.log"

    def error_file(self, rank: int) -> str:
        """Where torch's ``@record`` writes the rank's error (``TORCHELASTIC_ERROR_FILE``)."""
        return f"{self.log_dir}/rank-{rank}.error.json"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one rank needs to start, restore and train.

    The launcher fills in the rank's place; the documented fields (``pg_timeout_s``,
    ``report_interval_s``, ``fr_buffer_entries``, ``fr_poll_interval_s``) are defined
    here for cluster.yaml (job.pg_timeout_s, agent.report_interval_s,
    job.flight_recorder_entries, agent.fr_poll_interval_s) and the torchrun flags."""

    job_id: str
    attempt: int
    rank: int
    world_size: int
    node_name: str
    master_addr: str             # rendezvous (TCPStore) host, 127.0.0.1 locally
    master_port: int
    agent_address: str           # host:port of this node's NodeAgent service
    checkpoint_dir: str
    model: ModelArgs = field(default_factory=ModelArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    pg_timeout_s: float = _documented(
        60.0, "torch.distributed process-group timeout, seconds.", gt=0, le=86400)
    report_interval_s: float = _documented(
        0.5, "Seconds between a worker's reports to its node agent (also how long a command "
        "waits for its rank; status changes are sent at once).", gt=0, le=10)
    env: dict[str, str] = field(default_factory=dict)  # the launcher's extras (workers/env.py)
    external_store: bool = False  # a launcher (torchrun's agent) already serves the TCPStore
    fr_buffer_entries: int = _documented(
        256, "Native flight-recorder ring size per rank (TORCH_FR_BUFFER_SIZE); 0 = off. Each read "
        "costs ~5 us per entry; the ring is probed every 0.1 s and read early when half full, so 256 keeps "
        "up with ~1,000 collectives/s per rank; entries overwritten unread are counted and logged.",
        ge=0, le=1_000_000)
    fr_poll_interval_s: float = _documented(
        0.5, "Seconds between reads of a worker's native flight-recorder ring (events lag at most this).",
        gt=0, le=60)
    #: a user entrypoint to run (None: fleet's built-in trainer, in this process)
    launch: Launch | None = None
    #: the rank's place as torchrun names it: LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the
    #: node's index in the placement), GROUP_WORLD_SIZE; and TORCHELASTIC_MAX_RESTARTS
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0
    group_world_size: int = 1
    max_restarts: int = 0
    #: silent-data-corruption checks (cluster.yaml ``sdc:``): fingerprint the training state
    #: and compare the copies every this many steps (0 = off; triggers still force checks)
    sdc_check_interval: int = 0
    #: a grad norm, loss or update size this many times its running median forces a check
    sdc_trigger_factor: float = 10.0
    #: restore no step newer than this (0 = no limit): after silent data corruption, the
    #: newest state verified before it
    restore_at_most: int = 0
