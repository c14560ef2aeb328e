"""Run one benchmark in two checkouts, alternately, and compare their figures.

    python bench/compare_revisions.py --before DIR [--before-python PY] [--rounds 3]
                                      (--bench startup | --bench overhead) [-- BENCH ARGS...]

A refactoring must not make fleet slower, and on a shared machine two runs made an hour
apart differ by more than the change does. So this runs ``bench/<bench>.py`` of the
checkout ``--before`` (an older revision, e.g. ``git worktree add /tmp/before <rev>``,
with its own virtual environment, ``--before-python``, default ``DIR/.venv/bin/python``)
and of this checkout (its ``.venv``) one after the other, ``--rounds`` times, swapping
which goes first every round so machine noise hits both alike. Each run's last output
line is the benchmark's JSON; the figures compared are the medians over rounds of the
keys listed in ``KEYS`` for that benchmark, with ``after / before`` ratios. The last line
of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: figures compared per benchmark: dotted paths into the benchmark's JSON line
KEYS = {
    "startup": ("fleet.wall_s", "fleet.startup_s", "fleet.training_s", "fleet.teardown_s",
                "torchrun.wall_s", "startup_ratio", "training_ratio"),
    "overhead": ("median_step_s_on", "median_step_s_off", "overhead_ratio", "cpu_overhead_ratio",
                 "median_pair_ratio", "telemetry_cpu_share"),
}


def _pick(data: dict, dotted: str) -> float:
    for part in dotted.split("."):
        data = data[part]
    return float(data)


def run_bench(python: Path, checkout: Path, bench: str, args: list[str], timeout_s: float) -> dict:
    """One run of ``checkout/bench/<bench>.py``; its JSON line as a dict."""
    cmd = [str(python), str(checkout / "bench" / f"{bench}.py"), *args]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-20:])
        raise SystemExit(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{tail}")
    last = out.stdout.strip().splitlines()[-1]
    result = json.loads(last)
    print(f"    {checkout}: {time.perf_counter() - t0:.0f} s", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the older revision")
    parser.add_argument("--before-python", type=Path, help="its interpreter [DIR/.venv/bin/python]")
    parser.add_argument("--after-python", type=Path, default=REPO / ".venv" / "bin" / "python")
    parser.add_argument("--bench", choices=sorted(KEYS), required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: passed to the benchmark")
    ns = parser.parse_args()
    before = ns.before.resolve()
    before_py = ns.before_python or before / ".venv" / "bin" / "python"
    extra = [a for a in ns.bench_args if a != "--"]
    sides = {"before": (before_py, before), "after": (ns.after_python, REPO)}
    for name, (python, checkout) in sides.items():
        if not python.exists() or not (checkout / "bench" / f"{ns.bench}.py").exists():
            raise SystemExit(f"--{name}: no {python} or no bench/{ns.bench}.py in {checkout}")
    rev = {name: subprocess.run(["git", "-C", str(c), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() for name, (_, c) in sides.items()}
    print(f"bench/{ns.bench}.py {' '.join(extra)}: before {before} ({rev['before']}), after {REPO} "
          f"({rev['after']}), {ns.rounds} rounds", flush=True)

    results: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(ns.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        print(f"  round {i + 1}: {' then '.join(order)}", flush=True)
        for name in order:
            python, checkout = sides[name]
            results[name].append(run_bench(python, checkout, ns.bench, extra, ns.timeout_s))

    figures: dict[str, dict[str, float]] = {}
    print(f"\n{'median of ' + str(ns.rounds) + ' rounds':<28} {'before':>10} {'after':>10} {'after/before':>13}")
    for key in KEYS[ns.bench]:
        b = statistics.median(_pick(r, key) for r in results["before"])
        a = statistics.median(_pick(r, key) for r in results["after"])
        figures[key] = {"before": round(b, 4), "after": round(a, 4), "ratio": round(a / b, 4) if b else None}
        print(f"  {key:<26} {b:>10.4f} {a:>10.4f} {figures[key]['ratio'] or float('nan'):>13.3f}")
    print(json.dumps({"bench": ns.bench, "rounds": ns.rounds, "before_rev": rev["before"],
                      "after_rev": rev["after"], "bench_args": extra, "figures": figures,
                      "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
