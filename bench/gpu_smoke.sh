#!/usr/bin/env bash
# GPU smoke benchmark: the `small` preset on one NVIDIA GPU, FP8 (tensorwise and rowwise)
# against BF16, tokens/s and MFU; then NCCL all_gather bandwidth as fleet measures it from
# the flight recorder's traces (TORCH_NCCL_ENABLE_TIMING=1) against an nccl-tests-style
# timed loop on every GPU of the host (bench/gpu_collectives.py). Finishes within 10
# minutes on one H100/H200-class host.
#
#   bash bench/gpu_smoke.sh            # from the repository root, with .venv installed
#
# Each run is the real worker (`python -m fleet.workers.train` under torchrun, one rank, NCCL),
# 30 optimizer steps of 4 x 2048 tokens; the first 5 steps' share of the time is not
# excluded, so figures are slightly pessimistic. The last line is one JSON object.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible: this benchmark needs an NVIDIA GPU" >&2
    exit 2
fi
STEPS=${STEPS:-30}
BATCH=${BATCH:-4}
SEQ=${SEQ:-2048}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for mode in off tensorwise rowwise; do
    timeout 180 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m fleet.workers.train \
        --preset small --fp8 "$mode" --steps "$STEPS" --batch-size "$BATCH" --seq-len "$SEQ" \
        --warmup-steps 0 --checkpoint-dir "$out/ckpt-$mode" --checkpoint-interval 0 \
        > "$out/$mode.log" 2>&1 || { echo "fp8=$mode failed:"; tail -40 "$out/$mode.log"; exit 1; }
done
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())")
timeout 240 env TORCH_NCCL_ENABLE_TIMING=1 TORCH_NCCL_TRACE_BUFFER_SIZE=20000 \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" bench/gpu_collectives.py "$out/fr" \
    > "$out/collectives.log" 2>&1 || { echo "collectives failed:"; tail -40 "$out/collectives.log"; exit 1; }
grep -v '^{' "$out/collectives.log" | tail -12 || true
"$PY" - "$out" "$STEPS" "$BATCH" "$SEQ" <<'PYEOF'
import json, re, sys
from pathlib import Path
import torch
from fleet.workers import flops, metrics
from fleet.workers.spec import PRESETS
out, steps, batch, seq = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fpt = flops.flops_per_token(PRESETS["small"], seq)
peak = metrics.peak_flops(torch.device("cuda", 0))
res = {"device": torch.cuda.get_device_name(0), "steps": steps, "tokens_per_step": batch * seq,
       "flops_per_token": fpt, "peak_flops": peak}
for mode in ("off", "tensorwise", "rowwise"):
    text = (out / f"{mode}.log").read_text()
    r = json.loads(re.findall(r"FLEET_WORKER_RESULT (\{[^}]*\})", text)[-1])
    tps = steps * batch * seq / r["train_s"]
    key = "bf16" if mode == "off" else f"fp8_{mode}"
    res[f"tokens_per_s_{key}"] = round(tps, 1)
    res[f"mfu_{key}"] = round(metrics.mfu(fpt, tps, peak), 4)
    print(f"{key:>16}: {tps:10.0f} tokens/s  MFU {metrics.mfu(fpt, tps, peak):6.1%}")
res["fp8_speedup"] = round(res["tokens_per_s_fp8_tensorwise"] / res["tokens_per_s_bf16"], 3)
lines = [l for l in (out / "collectives.log").read_text().splitlines() if l.startswith("{")]
coll = json.loads(lines[-1])
res.update({f"nccl_all_gather_{k}": coll[k] for k in ("gpus", "compared", "max_busbw_rel_error", "median_rel_error",
                                                       "entries_with_duration")})
print(json.dumps(res))
PYEOF
