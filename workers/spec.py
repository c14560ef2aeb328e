"""What a worker is told to do: the model shape, the training recipe, and its place in the job.

These frozen dataclasses are the whole contract between the controller and a worker
process. The controller builds them from the validated cluster.yaml; a plain torchrun
launch can build them by hand. They hold only plain values so they pickle across Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelArgs:
    """Shape of the Llama-4-style decoder (see workers/model.py).

    Layer i is a NoPE layer (no rotary embedding, attention temperature tuning) when
    ``nope_every`` and ``(i + 1) % nope_every == 0``, as in Hugging Face's Llama 4
    config; the others use RoPE (optionally chunked local attention). Layer i is a MoE
    layer when ``n_experts`` and ``(i + 1) % moe_every == 0`` (Scout: every layer,
    Maverick: every second); the others have a dense SwiGLU of width ``ffn_hidden``.
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 0               # 0 = dim // n_heads
    ffn_hidden: int = 172           # dense layers' SwiGLU width (HF: intermediate_size_mlp)
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # iRoPE
    nope_every: int = 4             # 0 = RoPE on every layer
    attn_temperature_tuning: bool = True
    attn_floor_scale: float = 8192.0
    attn_scale: float = 0.1
    attention_chunk_size: int = 0   # >0: chunked local attention on RoPE layers
    # mixture of experts
    n_experts: int = 4              # routed experts per MoE layer; 0 = dense model
    top_k: int = 1
    n_shared_experts: int = 1
    moe_hidden: int = 128           # each expert's (and the shared expert's) SwiGLU width
    moe_every: int = 2              # interleave step: 1 = every layer is MoE
    load_balance: str = "aux_loss"  # "aux_loss" | "bias" (loss-free, bias-adjusted routing)
    aux_loss_coef: float = 0.01
    # numerics
    fp8: str = "off"                # "off" | "tensorwise" | "rowwise"

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
        if self.moe_every < 1:
            raise ValueError("moe_every must be >= 1")
        if self.load_balance not in ("aux_loss", "bias"):
            raise ValueError(f"load_balance must be 'aux_loss' or 'bias', not {self.load_balance!r}")
        if self.fp8 not in ("off", "tensorwise", "rowwise"):
            raise ValueError(f"fp8 must be 'off', 'tensorwise' or 'rowwise', not {self.fp8!r}")


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


@dataclass(frozen=True)
class TrainArgs:
    """The training recipe shared by every rank."""

    steps: int = 300
    batch_size: int = 4            # sequences per rank per micro-batch
    seq_len: int = 64
    lr: float = 3e-3               # peak learning rate
    seed: int = 0
    checkpoint_interval: int = 50  # steps between checkpoints; 0 = never
    keep_checkpoints: int = 3
    async_checkpoint: bool = True  # training goes on while a checkpoint is written
    memory_snapshots: bool = True  # copy the state to memory after every step (workers/snapshot.py)
    # recipe options
    grad_accum_steps: int = 1      # micro-batches per optimizer step
    grad_clip: float = 1.0         # max global grad norm; 0 = no clipping
    warmup_steps: int = 10         # linear warm-up from 0 to lr
    lr_schedule: str = "cosine"    # after warm-up: "cosine" (to min_lr_ratio*lr) | "constant"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    activation_checkpointing: bool = False  # recompute each block in backward
    # parallelism: world = dp * ep ranks; experts are sharded over ep, dense params over dp*ep
    ep_size: int = 1
    data_parallel: str = "fsdp"    # "fsdp" (FSDP2 fully_shard) | "ddp"
    # data: packed documents from a synthetic stream, or a memory-mapped token file
    dataset: str = "synthetic"     # "synthetic" | path to a flat uint16/uint32 token file
    mean_doc_len: int = 24         # synthetic documents' mean length (tokens)


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
    report_interval_s: float = 0.5
    env: dict[str, str] = field(default_factory=dict)  # set before the process group starts
    external_store: bool = False  # a launcher (torchrun's agent) already serves the TCPStore
    fr_buffer_entries: int = 256  # native flight-recorder ring size (TORCH_FR_BUFFER_SIZE); 0 = off
    fr_poll_interval_s: float = 0.5  # how often the reporter ships new ring entries
