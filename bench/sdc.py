"""Silent-data-corruption checks: what they cost per step, and what they catch.

    python bench/sdc.py [--blocks 4] [--steps 80] [--faults 56] [--seed 0] [--interval 10]

4 gloo ranks on 127.0.0.1 (2 simulated nodes x 2 ranks) train fleet's tiny Llama-4-style
MoE model with the built-in trainer (``fleet.workers.train.run``, telemetry discarded),
each rank its own process, as torchrun would start them. Three parts, one run:

  * **Overhead.** For N = 1, 10, 100: runs with fingerprint checks every N steps
    against runs with every check off (no fingerprints, no triggers), in blocks of four
    (off/on/on/off, then on/off/off/on: drift, and the first run of a block being slower,
    hit both sides alike). Per run the figure is the median step time (whole loop
    iteration, after the warm-up steps, slowest rank); ``overhead_ratio_nN`` is the median
    over blocks of mean(on)/mean(off); ``cpu_overhead_ratio_nN`` the same for CPU seconds
    per step of all ranks. Also measured inside the runs, free of noise: the seconds the
    checks themselves took per step (``check_cost_ratio_nN`` = 1 + that / step time).
  * **Detection.** ``--faults`` faults injected at random steps on random ranks, spread over
    weights, gradients, optimizer state and activations, on replicated state (``ddp``: four
    copies) and sharded state (``hsdp``: sharded inside a node, one copy per node), as
    single-bit flips at random bit positions and as finite relative errors (1e-3 .. 1e-1),
    with checks every ``--interval`` steps. A fault is detected when a verdict names it
    within the interval (a fingerprint mismatch, or a trigger whose replay proved it); every
    miss is listed with what happened instead.
  * **False incidents.** Every fault-free run with checks on (the overhead runs) counts the
    verdicts it produced; there must be none.

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORLD = 4
RANKS_PER_NODE = 2
WARMUP_STEPS = 10
TARGETS = ("weight", "grad", "optimizer", "activation")
LAYOUTS = ("ddp", "hsdp")


# ---- one rank: runs every trial of the plan, in order ------------------------------------

def _rank_main(rank: int, plan_path: str, out_path: str) -> None:
    """Child: train each trial of the plan as rank ``rank``; write one result per trial."""
    import socket

    import torch

    from fleet.proto import events_pb2
    from fleet.proto.kinds import FaultKind
    from fleet.workers import train
    from fleet.workers.faults import FaultHooks
    from fleet.workers.failures import SdcError
    from fleet.workers.spec import PRESETS, TrainArgs, WorkerSpec

    torch.set_num_threads(1)
    plan = json.loads(Path(plan_path).read_text())
    results = []
    for i, trial in enumerate(plan["trials"]):
        port_file = Path(plan["work"]) / f"trial-{i}.port"
        listen = None
        if rank == 0:
            listen = socket.create_server(("127.0.0.1", 0))
            port = listen.getsockname()[1]
            port_file.write_text(str(port))
        else:
            deadline = time.monotonic() + 120
            while not port_file.exists() or not port_file.read_text():
                if time.monotonic() > deadline:
                    raise SystemExit(f"rank {rank}: no rendezvous port for trial {i}")
                time.sleep(0.01)
            port = int(port_file.read_text())
        targs = TrainArgs(steps=trial["steps"], data_parallel=trial["layout"], ep_size=1, checkpoint_interval=0,
                          warmup_steps=5, seed=trial.get("seed", 0))
        spec = WorkerSpec(
            job_id=f"sdc-bench-{i}", attempt=1, rank=rank, world_size=WORLD, node_name=f"node-{rank // RANKS_PER_NODE}",
            master_addr="127.0.0.1", master_port=port, agent_address="", checkpoint_dir=str(Path(plan["work"]) / f"ckpt-{i}"),
            model=PRESETS["tiny"], train=targs, fr_buffer_entries=0,
            local_rank=rank % RANKS_PER_NODE, local_world_size=RANKS_PER_NODE, group_rank=rank // RANKS_PER_NODE,
            group_world_size=WORLD // RANKS_PER_NODE,
            sdc_check_interval=trial["interval"], sdc_trigger_factor=trial["trigger_factor"])
        hooks = FaultHooks(rank)
        fault = trial.get("fault")
        if fault and fault["rank"] == rank:
            fs = events_pb2.FaultSpec(kind=FaultKind.SDC.wire, at_step=fault["at_step"], target=fault["target"],
                                      value_error=fault.get("value_error", 0.0), persistent=False)
            if fault.get("bit") is not None:
                fs.bit = fault["bit"]
            hooks.on_command(events_pb2.Command(command_id=f"bench-{i}", fault=fs))
        row: dict = {"trial": i}
        try:
            res = train.run(spec, listen, hooks=hooks)
            row.update(step_wall_s=res["step_wall_s"], step_cpu_s=res["step_cpu_s"], sdc=res.get("sdc", []), sdc_check_s=res.get("sdc_check_s", 0.0),
                       final_step=res["final_step"])
        except SdcError as exc:
            row.update(step_wall_s=[], sdc=[{"first_bad_step": exc.step, "detected_step": exc.step,
                                              "suspects": [exc.rank], "verdict": exc.verdict, "replays": 0,
                                              "rollback_step": exc.rollback_step, "mechanism": "fingerprint"}],
                       error=str(exc))
        except Exception as exc:  # noqa: BLE001 - a trial that failed otherwise is reported, not fatal
            row.update(step_wall_s=[], sdc=[], error=f"{type(exc).__name__}: {exc}")
        finally:
            if listen is not None:
                listen.close()
        results.append(row)
        Path(out_path).write_text(json.dumps(results))


def _run_plan(trials: list[dict], work: Path, label: str, timeout_s: float) -> list[list[dict]]:
    """Run ``trials`` on WORLD rank processes; per trial, the list of every rank's result."""
    work.mkdir(parents=True, exist_ok=True)
    plan = work / f"{label}.json"
    plan.write_text(json.dumps({"work": str(work), "trials": trials}))
    outs = [work / f"{label}-rank{r}.json" for r in range(WORLD)]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(plan), str(outs[r])], cwd=REPO, env=env)
             for r in range(WORLD)]
    try:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    per_rank = [json.loads(o.read_text()) if o.exists() else [] for o in outs]
    return [[per_rank[r][i] if i < len(per_rank[r]) else {"error": "no result"} for r in range(WORLD)]
            for i in range(len(trials))]


def _step_s(ranks: list[dict]) -> float:
    """Median step time after the warm-up, slowest rank."""
    meds = [statistics.median(r["step_wall_s"][WARMUP_STEPS:]) for r in ranks if len(r.get("step_wall_s", [])) > WARMUP_STEPS]
    return max(meds) if len(meds) == WORLD else float("nan")


def _cpu_s(ranks: list[dict]) -> float:
    """CPU seconds per step of the whole job: every rank's median after the warm-up, summed."""
    meds = [statistics.median(r["step_cpu_s"][WARMUP_STEPS:]) for r in ranks if len(r.get("step_cpu_s", [])) > WARMUP_STEPS]
    return sum(meds) if len(meds) == WORLD else float("nan")


def _verdicts(ranks: list[dict]) -> list[dict]:
    """The triage outcomes of a trial (every rank reports the same ones: take the longest list)."""
    return max((r.get("sdc", []) for r in ranks), key=len)


# ---- the three parts ----------------------------------------------------------------------

def overhead(blocks: int, steps: int, work: Path) -> tuple[dict, int, list[str]]:
    """For N = 1, 10, 100: ``blocks`` blocks of four runs, off/on/on/off then on/off/off/on
    (ABBA: a drift, or the first run of a block being slower, hits both sides alike).
    Per block the ratio of the mean step times; the figure is the median over blocks.
    Also: CPU per step (all ranks), the checks' own measured cost, false incidents."""
    trials, tags = [], []
    for n in (1, 10, 100):
        for b in range(blocks):
            off = {"layout": "ddp", "steps": steps, "interval": 0, "trigger_factor": 0.0, "seed": b}
            on = {"layout": "ddp", "steps": steps, "interval": n, "trigger_factor": 10.0, "seed": b}
            for t in ((off, on, on, off) if b % 2 == 0 else (on, off, off, on)):
                trials.append(t)
                tags.append((n, b, "off" if t is off else "on"))
    t0 = time.monotonic()
    print(f"overhead: {len(trials)} runs of {steps} steps ...", flush=True)
    runs = _run_plan(trials, work / "overhead", "overhead", timeout_s=3600)
    print(f"overhead: done in {time.monotonic() - t0:.0f} s", flush=True)
    wall: dict[tuple[int, int], dict[str, list[float]]] = {}
    cpu: dict[tuple[int, int], dict[str, list[float]]] = {}
    check_s_per_step: dict[int, list[float]] = {1: [], 10: [], 100: []}
    false_incidents, notes = 0, []
    for (n, b, mode), ranks in zip(tags, runs, strict=True):
        errors = [r["error"] for r in ranks if r.get("error")]
        if errors:
            notes.append(f"N={n} block {b} {mode}: {errors[0]}")
        wall.setdefault((n, b), {}).setdefault(mode, []).append(_step_s(ranks))
        cpu.setdefault((n, b), {}).setdefault(mode, []).append(_cpu_s(ranks))
        if mode == "on":
            found = [v for v in _verdicts(ranks) if v.get("verdict") != "clean"]
            false_incidents += len(found)
            notes += [f"false incident N={n} block {b}: {v}" for v in found]
            check_s_per_step[n].append(max(r.get("sdc_check_s", 0.0) for r in ranks) / steps)
    out: dict = {"fault_free_runs_checked": sum(1 for t in tags if t[2] == "on")}
    for n in (1, 10, 100):
        ratios = [statistics.mean(wall[(n, b)]["on"]) / statistics.mean(wall[(n, b)]["off"]) for b in range(blocks)]
        cpu_ratios = [statistics.mean(cpu[(n, b)]["on"]) / statistics.mean(cpu[(n, b)]["off"]) for b in range(blocks)]
        off_s = [x for b in range(blocks) for x in wall[(n, b)]["off"]]
        out[f"overhead_ratio_n{n}"] = round(statistics.median(ratios), 4)
        out[f"block_ratios_n{n}"] = [round(r, 4) for r in ratios]
        out[f"cpu_overhead_ratio_n{n}"] = round(statistics.median(cpu_ratios), 4)
        out[f"step_ms_off_n{n}"] = round(statistics.median(off_s) * 1e3, 3)
        out[f"check_ms_per_step_n{n}"] = round(statistics.median(check_s_per_step[n]) * 1e3, 4)
        out[f"check_cost_ratio_n{n}"] = round(1 + out[f"check_ms_per_step_n{n}"] / out[f"step_ms_off_n{n}"], 5)
    return out, false_incidents, notes


def detection(faults: int, interval: int, seed: int, work: Path) -> dict:
    """Random faults, one per run: detected within the interval, culprit, replays, misses."""
    rng = random.Random(seed)
    trials = []
    for i in range(faults):
        target = TARGETS[i % len(TARGETS)]
        layout = LAYOUTS[(i // len(TARGETS)) % len(LAYOUTS)]
        at_step = rng.randint(WARMUP_STEPS + 2, WARMUP_STEPS + 2 + 2 * interval)
        fault = {"rank": rng.randrange(WORLD), "at_step": at_step, "target": target}
        # bit flips and relative errors in turn, per round of every (layout, target) pair
        if (i // (len(TARGETS) * len(LAYOUTS))) % 2 == 0:
            fault["bit"] = rng.randrange(32)
        else:
            fault["value_error"] = rng.choice((-1, 1)) * 10 ** rng.uniform(-3, -1)
        trials.append({"layout": layout, "steps": at_step + interval + 2, "interval": interval,
                       "trigger_factor": 10.0, "seed": i, "fault": fault})
    t0 = time.monotonic()
    print(f"detection: {faults} faulty runs, checks every {interval} steps ...", flush=True)
    runs = _run_plan(trials, work / "detection", "detection", timeout_s=3600)
    print(f"detection: done in {time.monotonic() - t0:.0f} s", flush=True)
    detected, right_culprit, latencies, replays, misses, by_target = 0, 0, [], [], [], {}
    for trial, ranks in zip(trials, runs, strict=True):
        f = trial["fault"]
        kind = f"bit {f['bit']}" if "bit" in f else f"relative error {f['value_error']:.2g}"
        what = f"{trial['layout']} {f['target']} {kind} on rank {f['rank']} at step {f['at_step']}"
        hit = next((v for v in _verdicts(ranks) if v.get("verdict") != "clean"
                    and 0 <= v.get("detected_step", -1) - f["at_step"] < interval), None)
        stats = by_target.setdefault(f"{trial['layout']}/{f['target']}", [0, 0])
        stats[1] += 1
        if hit is None:
            errors = [r["error"] for r in ranks if r.get("error")]
            seen = _verdicts(ranks)
            if errors:
                reason = errors[0]
            elif seen:
                reason = "verdicts " + "; ".join(f"{v.get('verdict')} at step {v.get('detected_step')}" for v in seen)
            elif f["target"] == "activation":
                reason = ("an activation error changes only this rank's local gradient, which the gradient "
                          "all-reduce hands to every copy alike, and no trigger fired")
            else:
                reason = "no check disagreed"
            misses.append(f"{what}: {reason}")
            continue
        detected += 1
        stats[0] += 1
        right_culprit += f["rank"] in hit.get("suspects", [])
        latencies.append(hit["detected_step"] - f["at_step"])
        replays.append(hit.get("replays", 0))
    return {
        "flips": faults, "detected": detected, "detected_ratio": round(detected / faults, 4),
        "culprit_named": right_culprit,
        "detect_latency_steps": statistics.median(latencies) if latencies else None,
        "detect_latency_steps_max": max(latencies) if latencies else None,
        "triage_replays_max": max(replays) if replays else 0,
        "triage_replays_median": statistics.median(replays) if replays else 0,
        "detected_by_target": {k: f"{v[0]}/{v[1]}" for k, v in sorted(by_target.items())},
        "misses": misses,
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        _rank_main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=4, help="off/on/on/off blocks per interval (default 4)")
    ap.add_argument("--steps", type=int, default=80, help="steps per overhead run (default 80)")
    ap.add_argument("--faults", type=int, default=56, help="faulty runs, one fault each (default 56)")
    ap.add_argument("--interval", type=int, default=10, help="check interval of the detection runs (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fault plan (default 0)")
    ap.add_argument("--skip-overhead", action="store_true", help="only the detection part")
    a = ap.parse_args()
    if a.blocks < 1 or a.steps <= WARMUP_STEPS + 5 or a.faults < 1 or a.interval < 1:
        ap.error(f"--blocks >= 1, --steps > {WARMUP_STEPS + 5}, --faults >= 1 and --interval >= 1")
    with tempfile.TemporaryDirectory(prefix="fleet-sdc-bench-") as tmp:
        work = Path(tmp)
        result: dict = {}
        notes: list[str] = []
        false_incidents = 0
        if not a.skip_overhead:
            ov, false_incidents, notes = overhead(a.blocks, a.steps, work)
            result.update(ov)
            for n in (1, 10, 100):
                print(f"N={n:<4} step time ratio on/off {ov[f'overhead_ratio_n{n}']:.4f} "
                      f"(blocks {ov[f'block_ratios_n{n}']}), CPU per step {ov[f'cpu_overhead_ratio_n{n}']:.4f}, "
                      f"the checks themselves {ov[f'check_ms_per_step_n{n}']:.3f} ms/step of "
                      f"{ov[f'step_ms_off_n{n}']:.1f} ms = {ov[f'check_cost_ratio_n{n}']:.5f}")
        det = detection(a.faults, a.interval, a.seed, work)
        result.update(det)
        result["false_incidents"] = false_incidents
        result["check_interval_detection"] = a.interval
        print(f"detected {det['detected']}/{det['flips']} within {a.interval} steps "
              f"(culprit named {det['culprit_named']}), latency median {det['detect_latency_steps']} steps, "
              f"replays max {det['triage_replays_max']}")
        for k, v in det["detected_by_target"].items():
            print(f"  {k:<20} {v}")
        for m in det["misses"]:
            print(f"  miss: {m}")
        for n in notes:
            print(f"  note: {n}")
        print(f"false incidents over fault-free runs: {false_incidents}")
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
