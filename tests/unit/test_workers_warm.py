"""A warm process (``WorkerActor.warm``) is ready to take a rank at once: what torch loads
lazily on the first DDP or FSDP2 wrap is imported, and what it imported is frozen out of the
garbage collector's sight. A spare (``background``) imports all of it on a thread of Linux's
idle scheduling class, so that it takes no CPU from busy ranks; a process an attempt waits
for imports the trainer on its own thread, at its own priority. Run in a fresh interpreter:
freezing pytest's own would leak into other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import gc, json, os, sys, threading

seen = {}

class Watch:  # records the thread and scheduling class that imports the trainer
    def find_spec(self, name, path=None, target=None):
        if name == "fleet.workers.train" and name not in seen:
            seen[name] = [threading.current_thread().name, os.sched_getscheduler(0)]
        return None

sys.meta_path.insert(0, Watch())
from fleet.workers.ray_actor import WorkerActor
before = "torch._dynamo" in sys.modules
assert WorkerActor().warm(None, BACKGROUND) is True
print(json.dumps({"dynamo_before": before, "dynamo_after": "torch._dynamo" in sys.modules,
                  "frozen": gc.get_freeze_count(), "tracked_young": len(gc.get_objects()),
                  "train_imported_by": seen.get("fleet.workers.train"),
                  "main_policy": os.sched_getscheduler(0)}))
"""


@pytest.mark.parametrize("background", [False, True], ids=["for-an-attempt", "spare"])
def test_a_warm_process_has_imported_the_lazy_modules_and_frozen_them(background: bool) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE.replace("BACKGROUND", str(background))],
                         capture_output=True, text=True, timeout=180, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert not seen["dynamo_before"] and seen["dynamo_after"]
    # the imports' objects are out of the collector's generations, and far outnumber what is left
    assert seen["frozen"] > 100_000
    assert seen["tracked_young"] < seen["frozen"] / 10
    thread, policy = seen["train_imported_by"]
    if background:
        assert (thread, policy) == ("fleet-warm-import", os.SCHED_IDLE)
    else:
        assert thread == "MainThread" and policy == os.SCHED_OTHER
    assert seen["main_policy"] == os.SCHED_OTHER  # the thread that will train keeps its class
