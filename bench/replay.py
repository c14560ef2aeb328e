"""Desync diagnosis from native flight-recorder dumps: `fleet replay --dumps` vs torchfrtrace.

    python bench/replay.py [--sizes 8,64,512] [--entries 2000] [--cases hang,...]
                           [--repeats 3] [--large-repeats 1] [--dir DIR]

For every size (ranks) and case, bench/fr_dumps.py writes one native-format dump per
rank (torch 2.13's pickle format, NCCL-style, ``--entries`` entries per rank) with a
planted fault and culprit. Two jobs: a mixture-of-experts job with world,
expert-parallel and data-parallel groups (cases healthy, hang, op/size/dtype mismatch,
sub-group hang; rank 0 is the culprit of hang and dtype_mismatch), and a Megatron-style
TP x PP x DP job with EP and pipeline send/recv (bench/fr_megatron.py: healthy,
pipeline hang, recv from a wrong peer, a dead rank without a file (NCCL and gloo
formats), a blocked majority, a stuck kernel (full, onlyActive and empty dumps), two
independent culprits). A dead rank's file is absent: every tool reads what is there.
Then, on the same folder, in the same run, each as a subprocess:
  * floor: a fresh interpreter that only ``pickle.load``s every file in a loop (each
    dump dropped before the next): what any reader of these files must pay;
  * fleet: ``fleet replay --dumps DIR --prefix P --json``; its ``culprit_ranks``;
  * torchfrtrace: ``torchfrtrace DIR --prefix P``; the first culprit its log names
    (``missing ranks: {...}`` or ``error msg: Culprit rank N; ...``), every later
    report kept too; a crash names no culprit.
A tool is correct on a case when the set of ranks it names equals the planted set
(empty for healthy). torchfrtrace matches each collective against the rank whose file
the directory lists first and blames whoever differs from it, so the rank it takes as
reference is reported per folder.

Wall time is perf_counter around the subprocess (interpreter start and imports
included, as a user waits for them); peak memory is the largest summed RSS of the
process and all its children, polled every 15 ms (shared pages of a process pool are
counted once per process, so fleet is charged conservatively). Per case the figure is
the median over ``--repeats`` runs (torchfrtrace runs ``--large-repeats`` times at 512
ranks and above); per size, times are the median over cases and memory the largest.
The runs of one case are interleaved (floor, fleet, torchfrtrace, ...) so machine noise
hits all alike. Dumps are written to a temporary folder, removed size by size (``--dir``
keeps and reuses them). The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import fr_dumps  # noqa: E402

TOOLS = ("floor", "fleet", "torchfrtrace")
POLL_S = 0.015

FLOOR_SRC = """
import os, pickle, sys
folder, prefix = sys.argv[1], sys.argv[2]
n = 0
for name in sorted(os.listdir(folder)):
    if name.startswith(prefix) and name[len(prefix):].isdigit():
        with open(os.path.join(folder, name), "rb") as f:
            dump = pickle.load(f)
        n += len(dump["entries"])
        del dump
print(n)
"""

_MISSING = re.compile(r"missing ranks: \{([\d, ]*)\}")
_CULPRIT = re.compile(r"Culprit rank (\d+)")


@dataclass
class Run:
    """One subprocess: wall time, peak memory of its process tree, what it printed."""

    wall_s: float
    peak_mb: float
    rc: int | None
    out: str
    err: str
    timed_out: bool = False
    valid: bool = True     # produced an answer (a crashed or garbled run has no figures)


def measure(cmd: list[str], timeout_s: float) -> Run:
    """Run ``cmd`` to completion (killed after ``timeout_s``), polling its tree's RSS."""
    peak = 0
    stop = threading.Event()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def sample() -> None:
        nonlocal peak
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not stop.is_set():
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            peak = max(peak, total)
            stop.wait(POLL_S)

    sampler = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    sampler.start()
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        out, err = proc.communicate(timeout=30)
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join(timeout=5)
    return Run(wall, peak / 2**20, proc.returncode, out, err, timed_out)


# --- the tools ------------------------------------------------------------------------

def torchfrtrace_cmd() -> list[str]:
    script = Path(sys.executable).parent / "torchfrtrace"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]


def parse_torchfrtrace(text: str) -> list[list[int]]:
    """Every culprit report in torchfrtrace's log, in order: ranks of a ``missing
    ranks`` line, or the ranks of one ``error msg: Culprit rank ...`` line."""
    reports = []
    for line in text.splitlines():
        m = _MISSING.search(line)
        if m:
            reports.append(sorted(int(x) for x in m.group(1).replace(" ", "").split(",") if x))
        elif "error msg:" in line and "Culprit rank" in line:
            reports.append(sorted({int(x) for x in _CULPRIT.findall(line)}))
    return reports


def run_tool(tool: str, folder: Path, prefix: str, timeout_s: float) -> tuple[Run, dict[str, Any]]:
    """One run of ``tool`` on ``folder``: the measurement and what it concluded."""
    if tool == "floor":
        run = measure([sys.executable, "-c", FLOOR_SRC, str(folder), prefix], timeout_s)
        ok = run.rc == 0
        return run, {"ok": ok, "entries": int(run.out.strip() or 0) if ok else None,
                     "error": None if ok else _tail(run)}
    if tool == "fleet":
        run = measure([sys.executable, "-m", "fleet.controlplane.cli.main", "replay", "--dumps", str(folder),
                       "--prefix", prefix, "--json"], timeout_s)
        try:
            doc = json.loads(run.out)
            return run, {"ok": True, "named": sorted(doc.get("culprit_ranks") or []),
                         "verdict": doc.get("verdict"), "missing_ranks": doc.get("missing_ranks"),
                         "rc": run.rc, "error": None}
        except (json.JSONDecodeError, AttributeError):
            return run, {"ok": False, "named": None, "verdict": None, "rc": run.rc, "error": _tail(run)}
    run = measure([*torchfrtrace_cmd(), str(folder), "--prefix", prefix], timeout_s)
    text = run.err + "\n" + run.out
    crashed = run.rc != 0 or "Traceback (most recent call last)" in text
    reports = parse_torchfrtrace(text)
    return run, {"ok": not crashed, "named": None if crashed else (reports[0] if reports else []),
                 "reports": reports[:6], "n_reports": len(reports), "rc": run.rc,
                 "error": _tail(run) if crashed else None}


def _tail(run: Run, n: int = 600) -> str:
    if run.timed_out:
        return f"timed out after {run.wall_s:.0f} s"
    text = (run.err.strip() or run.out.strip())
    return f"exit {run.rc}: {text[-n:]}"


def reference_rank(folder: Path, prefix: str) -> int | None:
    """The rank whose file the directory lists first: torchfrtrace's reference rank."""
    for name in os.listdir(folder):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return int(name[len(prefix):])
    return None


# --- dumps ----------------------------------------------------------------------------

def ensure_dumps(root: Path, ranks: int, entries: int, case: str, frames: int,
                 workers: int) -> tuple[Path, dict[str, Any]]:
    """The folder of ``case`` at ``ranks`` x ``entries`` (generated unless cached)."""
    folder = root / f"{ranks}x{entries}" / case
    manifest = root / f"{ranks}x{entries}-{case}.json"
    want = {"generator": "bench.fr_dumps", "frames": frames, "seed": 0,
            **fr_dumps.plant(case, ranks, entries).as_dict()}
    if manifest.exists() and json.loads(manifest.read_text()) == want and all(
            (folder / f"{fr_dumps.PREFIX}{r}").exists() for r in range(ranks) if r not in want["missing_ranks"]):
        return folder, want
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if done == total or now - last[0] > 5:
            last[0] = now
            print(f"    generating {ranks}x{entries} {case}: {done}/{total} ranks "
                  f"({now - t0:.0f} s)", flush=True)

    fr_dumps.generate(folder, ranks, entries, case, frames=frames, workers=workers, progress=progress)
    manifest.write_text(json.dumps(want))
    return folder, want


# --- one case ---------------------------------------------------------------------------

@dataclass
class CaseResult:
    ranks: int
    case: str
    planted: list[int]
    verdict: str
    reference_rank: int | None
    bytes: int
    runs: dict[str, list[Run]] = field(default_factory=dict)
    answers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def wall(self, tool: str) -> float | None:
        runs = [r.wall_s for r in self.runs.get(tool, []) if r.valid]
        return statistics.median(runs) if runs else None

    def peak(self, tool: str) -> float | None:
        runs = [r.peak_mb for r in self.runs.get(tool, []) if r.valid]
        return statistics.median(runs) if runs else None

    def named(self, tool: str) -> list[int] | None:
        answers = self.answers.get(tool) or []
        return answers[0]["named"] if answers else None

    def consistent(self, tool: str) -> bool:
        return len({json.dumps(a.get("named")) for a in self.answers.get(tool, [])}) <= 1

    def correct(self, tool: str) -> bool:
        named = self.named(tool)
        return named is not None and set(named) == set(self.planted) and self.consistent(tool)

    def row(self, tools: list[str]) -> dict[str, Any]:
        d: dict[str, Any] = {"ranks": self.ranks, "case": self.case, "planted": self.planted,
                             "expected_verdict": self.verdict, "torchfrtrace_reference_rank": self.reference_rank,
                             "dump_mb": round(self.bytes / 2**20, 1)}
        for t in tools:
            w, p = self.wall(t), self.peak(t)
            d[f"{t}_s"] = None if w is None else round(w, 3)
            d[f"{t}_runs_s"] = [round(r.wall_s, 3) for r in self.runs.get(t, [])]
            d[f"{t}_peak_mb"] = None if p is None else round(p, 1)
            if t == "floor":
                continue
            a = (self.answers.get(t) or [{}])[0]
            d[f"{t}_named"] = a.get("named")
            d[f"{t}_correct"] = self.correct(t)
            if not self.consistent(t):
                d[f"{t}_named_per_run"] = [x.get("named") for x in self.answers[t]]
            if a.get("error"):
                d[f"{t}_error"] = a["error"]
            if t == "fleet":
                d["fleet_verdict"] = a.get("verdict")
                d["fleet_verdict_correct"] = a.get("verdict") == self.verdict
            if t == "torchfrtrace":
                d["torchfrtrace_reports"] = a.get("reports")
                d["torchfrtrace_n_reports"] = a.get("n_reports")
        if "fleet" in tools and "torchfrtrace" in tools and self.wall("fleet") and self.wall("torchfrtrace"):
            d["speedup"] = round(self.wall("torchfrtrace") / self.wall("fleet"), 2)
        if "fleet" in tools and "floor" in tools and self.wall("fleet") and self.wall("floor"):
            d["fleet_floor_ratio"] = round(self.wall("fleet") / self.wall("floor"), 2)
        return d


def run_case(root: Path, ranks: int, case: str, opts: argparse.Namespace, tools: list[str]) -> CaseResult:
    folder, plant = ensure_dumps(root, ranks, opts.entries, case, opts.frames, opts.workers)
    size = sum(f.stat().st_size for f in folder.iterdir())
    res = CaseResult(ranks, case, plant["culprit_ranks"], plant["verdict"],
                     reference_rank(folder, fr_dumps.PREFIX), size)
    repeats = {t: opts.repeats for t in tools}
    if ranks >= 512 and "torchfrtrace" in repeats:
        repeats["torchfrtrace"] = opts.large_repeats
    if "floor" in repeats:
        repeats["floor"] = max(1, min(opts.repeats, 3))
    for i in range(max(repeats.values())):
        for t in tools:
            if i >= repeats[t]:
                continue
            run, answer = run_tool(t, folder, fr_dumps.PREFIX, opts.timeout_s)
            run.valid = bool(answer["ok"])
            res.runs.setdefault(t, []).append(run)
            res.answers.setdefault(t, []).append(answer)
            named = answer.get("named")
            note = "" if t == "floor" else f", names {named}" + (f" ({answer['error']})" if answer.get("error") else "")
            print(f"    {t:<12} run {i + 1}: {run.wall_s:7.2f} s, peak {run.peak_mb:7.0f} MB{note}", flush=True)
    return res


# --- report ---------------------------------------------------------------------------

def summarize(results: list[CaseResult], tools: list[str], sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in sizes:
        rs = [r for r in results if r.ranks == n]
        for t in tools:
            walls = [r.wall(t) for r in rs if r.wall(t) is not None]
            peaks = [r.peak(t) for r in rs if r.peak(t) is not None]
            out[f"{t}_s_{n}"] = round(statistics.median(walls), 3) if walls else None
            out[f"{t}_peak_mb_{n}"] = round(max(peaks), 1) if peaks else None
        f, tf, fl = out.get(f"fleet_s_{n}"), out.get(f"torchfrtrace_s_{n}"), out.get(f"floor_s_{n}")
        if f and tf:
            out[f"speedup_{n}"] = round(tf / f, 2)
            sp = [r.wall("torchfrtrace") / r.wall("fleet") for r in rs
                  if r.wall("fleet") and r.wall("torchfrtrace")]
            out[f"speedup_min_{n}"] = round(min(sp), 2)
        if f and fl:
            out[f"fleet_floor_ratio_{n}"] = round(f / fl, 2)
        if tf and fl:
            out[f"torchfrtrace_floor_ratio_{n}"] = round(tf / fl, 2)
        fp, tp = out.get(f"fleet_peak_mb_{n}"), out.get(f"torchfrtrace_peak_mb_{n}")
        if fp and tp:
            out[f"memory_ratio_{n}"] = round(fp / tp, 3)
    for t in ("fleet", "torchfrtrace"):
        if t in tools:
            out[f"{t}_correct"] = sum(r.correct(t) for r in results)
            out[f"{t}_wrong"] = [{"ranks": r.ranks, "case": r.case, "planted": r.planted, "named": r.named(t)}
                                 for r in results if not r.correct(t)]
    if "fleet" in tools:
        out["fleet_verdict_correct"] = sum(
            (r.answers.get("fleet") or [{}])[0].get("verdict") == r.verdict for r in results)
    out["cases"] = len(results)
    return out


def print_table(results: list[CaseResult], tools: list[str]) -> None:
    print("\nper case (medians; s = wall seconds, MB = peak RSS of the process tree)")
    head = f"{'ranks':>5} {'case':<15} {'planted':<9}"
    for t in tools:
        head += f" {t + ' s':>16} {'MB':>7}"
    head += f" {'speedup':>8} {'fleet names':<14} {'frt names':<14} {'frt ref':>7}"
    print(head)
    for r in results:
        line = f"{r.ranks:>5} {r.case:<15} {str(r.planted):<9}"
        for t in tools:
            w, p = r.wall(t), r.peak(t)
            line += f" {('-' if w is None else f'{w:.2f}'):>16} {('-' if p is None else f'{p:.0f}'):>7}"
        sp = (r.wall("torchfrtrace") / r.wall("fleet")) if r.wall("fleet") and r.wall("torchfrtrace") else None
        line += f" {('-' if sp is None else f'{sp:.1f}x'):>8}"
        for t in ("fleet", "torchfrtrace"):
            named = r.named(t) if t in tools else None
            mark = "" if t not in tools else (" ok" if r.correct(t) else " WRONG")
            line += f" {(str(named) + mark)[:14]:<14}"
        line += f" {str(r.reference_rank):>7}"
        print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,64,512", help="ranks per job, comma-separated")
    ap.add_argument("--entries", type=int, default=2000, help="flight-recorder entries per rank")
    ap.add_argument("--cases", default=",".join(fr_dumps.CASES))
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--large-repeats", type=int, default=1, help="torchfrtrace runs at >= 512 ranks")
    ap.add_argument("--frames", type=int, default=fr_dumps.FRAMES, help="stack frames per entry")
    ap.add_argument("--workers", type=int, default=2, help="processes generating dumps")
    ap.add_argument("--timeout-s", type=float, default=1800, help="limit of every subprocess")
    ap.add_argument("--dir", default=None, help="keep and reuse the dumps here (default: a temp dir)")
    opts = ap.parse_args()
    sizes = [int(s) for s in opts.sizes.split(",")]
    cases = opts.cases.split(",")
    tools = [t for t in TOOLS if t in opts.tools.split(",")]
    for c in cases:
        if c not in fr_dumps.CASES:
            ap.error(f"--cases: unknown case {c!r}; one of {', '.join(fr_dumps.CASES)}")
        for n in sizes:
            try:
                fr_dumps.plant(c, n, opts.entries)
            except ValueError as exc:
                ap.error(f"--sizes {n} with case {c}: {exc}")
    keep = opts.dir is not None
    root = Path(opts.dir) if keep else Path(tempfile.mkdtemp(prefix="fleet-bench-replay-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"sizes {sizes} x {opts.entries} entries, cases {cases}, tools {tools}; repeats {opts.repeats} "
          f"(torchfrtrace {opts.large_repeats} at >= 512 ranks); {opts.frames} frames per entry; dumps in {root}",
          flush=True)
    results: list[CaseResult] = []
    t_start = time.perf_counter()
    try:
        for n in sizes:
            for c in cases:
                print(f"  {n} ranks, {c}:", flush=True)
                results.append(run_case(root, n, c, opts, tools))
            if not keep:
                shutil.rmtree(root / f"{n}x{opts.entries}", ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    print_table(results, tools)
    summary = summarize(results, tools, sizes)
    print("\nper size (time: median over cases; memory: largest case)")
    for n in sizes:
        parts = [f"{t} {summary.get(f'{t}_s_{n}')} s / {summary.get(f'{t}_peak_mb_{n}')} MB" for t in tools]
        extra = [f"{k} {summary[f'{k}_{n}']}" for k in ("speedup", "speedup_min", "fleet_floor_ratio",
                                                         "torchfrtrace_floor_ratio", "memory_ratio")
                 if summary.get(f"{k}_{n}") is not None]
        print(f"  {n:>4} ranks: " + "; ".join(parts + extra))
    for t in ("fleet", "torchfrtrace"):
        if t in tools:
            print(f"  {t} correct on {summary[f'{t}_correct']}/{summary['cases']} cases"
                  + "".join(f"; wrong: {w['ranks']} ranks {w['case']} named {w['named']} (planted "
                            f"{w['planted']})" for w in summary[f"{t}_wrong"]))
    result = {"bench": "replay", "entries": opts.entries, "frames": opts.frames, "repeats": opts.repeats,
              "large_repeats": opts.large_repeats, "sizes": sizes, "case_names": cases,
              "elapsed_s": round(time.perf_counter() - t_start, 1), **summary,
              "rows": [r.row(tools) for r in results]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
