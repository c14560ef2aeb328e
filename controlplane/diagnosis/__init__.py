"""The diagnosis engine: desync verdicts over collective traces, from dumps or the store
(any ``TraceSource``, ``controlplane.diagnosis.source``).

Pure Python (no torch, Ray or gRPC), so `fleet replay --dumps` runs anywhere, fast.

    >>> from fleet.controlplane.diagnosis import analyze_dumps
    >>> d = analyze_dumps("/tmp/fr")            # a folder of native dumps, one per rank
    >>> d.verdict, d.culprit_ranks               # e.g. ("hang", [2])
"""

from __future__ import annotations

import os

from fleet.controlplane.diagnosis.dumps import load_traces
from fleet.controlplane.diagnosis.engine import (
    Diagnosis,
    DiagnosisConfig,
    Finding,
    GroupInfo,
    Wavefront,
    diagnose,
)
from fleet.controlplane.diagnosis.source import TraceSource, attempt_traces, diagnose_attempt, recent_traces
from fleet.controlplane.diagnosis.traces import SignatureTable, TraceBuilder, TraceSet

__all__ = [
    "Diagnosis", "DiagnosisConfig", "Finding", "GroupInfo", "SignatureTable", "TraceBuilder",
    "TraceSet", "TraceSource", "Wavefront", "analyze_dumps", "attempt_traces", "diagnose",
    "diagnose_attempt", "load_traces", "recent_traces",
]


def analyze_dumps(folder: str | os.PathLike, prefix: str | None = None,
                  config: DiagnosisConfig = DiagnosisConfig(), **load_kw: object) -> Diagnosis:
    """Load a folder of native flight-recorder dumps and diagnose it."""
    return diagnose(load_traces(folder, prefix, **load_kw), config)  # type: ignore[arg-type]
