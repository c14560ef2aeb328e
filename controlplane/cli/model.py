"""`fleet model-info`: parameter counts, layer layout and FLOPs of a model preset."""

from __future__ import annotations

from typing import Annotated

import typer

from fleet.controlplane.cli.common import JsonOpt
from fleet.controlplane.cli.render import print_json, print_table
from fleet.controlplane.errors import ConfigError

PresetOpt = Annotated[str, typer.Option("--preset", help="Model preset (workers/spec.py PRESETS).")]


def _human(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _layers(ids: list[int], n_layers: int) -> str:
    return f"{len(ids)}/{n_layers}" + (f" ({', '.join(map(str, ids))})" if len(ids) <= 8 else "")


def model_info(preset: PresetOpt = "tiny", json_out: JsonOpt = False) -> None:
    """Show a preset's total and active parameters, MoE/NoPE layers and FLOPs per token."""
    # torch is imported here, not at module load, so other commands start fast.
    from fleet.workers.flops import describe
    from fleet.workers.spec import PRESETS

    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; valid presets: {', '.join(sorted(PRESETS))}")
    info = {"preset": preset, **describe(PRESETS[preset])}
    if json_out:
        print_json(info)
        return
    print_table(
        None,
        ["preset", "total params", "active params", "layers", "MoE layers", "NoPE layers",
         "experts", "top-k", "FLOPs/token", "seq len"],
        [[preset, _human(info["total_params"]), _human(info["active_params"]), info["n_layers"],
          _layers(info["moe_layers"], info["n_layers"]), _layers(info["nope_layers"], info["n_layers"]),
          info["n_experts"], info["top_k"], f"{info['flops_per_token']:.3e}", info["seq_len"]]],
    )
