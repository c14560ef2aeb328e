"""workers/flops.py and `fleet model-info`: counts on the meta device, FLOPs, CLI output."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from fleet.controlplane.cli.model import model_info
from fleet.controlplane.errors import ConfigError
from fleet.workers.flops import meta_model, embedding_params, flops_per_token, param_counts
from fleet.workers.model import Transformer
from fleet.workers.spec import PRESETS, ModelArgs

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("preset", "total", "active"), [
    ("scout", 109e9, 17e9),      # Meta: Llama 4 Scout, 17B active / 109B total
    ("maverick", 400e9, 17e9),   # Meta: Llama 4 Maverick, 17B active / 400B total
])
def test_llama4_counts_match_published(preset, total, active):
    got_total, got_active = param_counts(PRESETS[preset])
    assert got_total == pytest.approx(total, rel=0.03)
    assert got_active == pytest.approx(active, rel=0.03)


def test_meta_build_allocates_nothing():
    model = meta_model(PRESETS["maverick"])
    assert all(p.is_meta for p in model.parameters())


def test_counts_agree_with_a_real_model():
    args = ModelArgs(top_k=2)
    model = Transformer(args)
    total, active = param_counts(args)
    assert total == sum(p.numel() for p in model.parameters())
    per_expert = 3 * args.dim * args.moe_hidden
    assert total - active == len(model.moe_layers()) * (args.n_experts - args.top_k) * per_expert
    dense = ModelArgs(n_experts=0)
    assert param_counts(dense)[0] == param_counts(dense)[1]


def test_flops_per_token_formula():
    args = ModelArgs()
    _, active = param_counts(args)
    attention = 12 * args.n_layers * args.n_heads * args.head_size * 64
    assert flops_per_token(args, 64) == 6 * (active - embedding_params(args)) + attention
    # chunked RoPE layers attend to at most one chunk
    chunked = ModelArgs(attention_chunk_size=16)
    n_rope = sum(not chunked.is_nope_layer(i) for i in range(chunked.n_layers))
    saved = 12 * n_rope * chunked.n_heads * chunked.head_size * (64 - 16)
    assert flops_per_token(chunked, 64) == flops_per_token(args, 64) - saved


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("model-info")(model_info)
    app.command("noop")(lambda: None)  # keeps typer in multi-command mode
    return app


def test_model_info_json():
    result = CliRunner().invoke(_app(), ["model-info", "--preset", "scout", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["preset"] == "scout"
    assert info["total_params"] == param_counts(PRESETS["scout"])[0]
    assert info["n_layers"] == 48 and len(info["moe_layers"]) == 48 and len(info["nope_layers"]) == 12
    assert info["n_experts"] == 16 and info["top_k"] == 1
    assert info["flops_per_token"] == flops_per_token(PRESETS["scout"], 8192)


def test_model_info_table():
    result = CliRunner().invoke(_app(), ["model-info", "--preset", "maverick"])
    assert result.exit_code == 0, result.output
    assert "maverick" in result.output and "400.71B" in result.output and "24/48" in result.output


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ConfigError, match="maverick, scout, small, tiny"):
        model_info("huge")
