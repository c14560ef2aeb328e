"""bench/scale.py --quick: 128 simulated ranks (16 agent streams over 2 processes) against
the real controller on a SQLite file; one planted hang, a reconnect storm, a replay.

The smoke run of the scale benchmark: the JSON line carries every key the issue asks for,
the hang's culprit is named (rank and node), no stream was refused, every event was
stored exactly once across a SIGKILL of the controller, and ``fleet replay`` answered.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)

KEYS = ("ranks", "detect_s", "ingest_lag_s", "controller_cpu_s_per_rank_s", "controller_rss_mib",
        "replay_s_16384", "reconnect_s_2048", "desync_ok", "refused", "store", "trials")


def test_quick_run_names_the_hang_and_stores_everything_once() -> None:
    proc = subprocess.run([sys.executable, "bench/scale.py", "--quick", "--seed", "3"], cwd=REPO,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(KEYS) <= out.keys()
    assert out["ranks"] == [128] and out["store"] == "sqlite"
    assert out["named"] == [1], proc.stdout          # the hang trial named the right rank and node
    assert out["detect_s"][0] is not None and 0 < out["detect_s"][0] < 20
    assert out["refused"] == [0] and out["rejected"] == [0]
    assert out["ingest_lag_s"][0] is not None and out["ingest_lag_s"][0] < 5
    assert out["controller_cpu_s_per_rank_s"][0] > 0 and out["controller_rss_mib"][0] > 0
    storm = out["reconnect"]
    assert storm["streams"] == 16 and storm["reconnect_s"] is not None
    assert storm["exactly_once"], storm
    assert storm["steps_rows"] == storm["steps_keys"] == storm["steps_sent"] > 0
    assert storm["batches_stored"] == storm["batches_sent"] > 0
    assert out["replay_ok"] and out["replay_names_culprit"], proc.stdout


def test_bad_ranks_is_one_clear_line() -> None:
    proc = subprocess.run([sys.executable, "bench/scale.py", "--ranks", "100"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --ranks: must be a positive multiple of 32, got 100"
