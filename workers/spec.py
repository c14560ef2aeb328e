"""What a worker is told to do: the model shape, the training recipe, and its place in the job.

These frozen dataclasses are the whole contract between the controller and a worker
process. The controller builds them from the validated cluster.yaml; a plain torchrun
launch can build them by hand. They hold only plain values so they pickle across Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelArgs:
    """Shape of the Llama-style decoder (see workers/model.py)."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 172
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError("head dimension (dim / n_heads) must be even for RoPE")


#: Named model shapes. ``tiny`` trains at several steps/s with 4 ranks on 2 CPU cores.
PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(),
    "small": ModelArgs(
        vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4,
        ffn_hidden=2816, max_seq_len=2048,
    ),
}


@dataclass(frozen=True)
class TrainArgs:
    """The training recipe shared by every rank."""

    steps: int = 300
    batch_size: int = 4          # sequences per rank per step
    seq_len: int = 64
    lr: float = 3e-3
    seed: int = 0
    checkpoint_interval: int = 50  # steps between checkpoints; 0 = never
    keep_checkpoints: int = 3


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one rank needs to start, restore and train."""

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
    pg_timeout_s: float = 60.0
    report_interval_s: float = 0.1
    env: dict[str, str] = field(default_factory=dict)  # set before the process group starts
    external_store: bool = False  # a launcher (torchrun's agent) already serves the TCPStore
