"""A warm process (``WorkerActor.warm``) is ready to take a rank at once: what torch loads
lazily on the first DDP or FSDP2 wrap is imported, and what it imported is frozen out of the
garbage collector's sight. Run in a fresh interpreter: freezing pytest's own would leak into
other tests."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json, sys
from fleet.workers.ray_actor import WorkerActor
before = "torch._dynamo" in sys.modules
assert WorkerActor().warm() is True
print(json.dumps({"dynamo_before": before, "dynamo_after": "torch._dynamo" in sys.modules,
                  "frozen": gc.get_freeze_count(), "tracked_young": len(gc.get_objects())}))
"""


def test_a_warm_process_has_imported_the_lazy_modules_and_frozen_them() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert not seen["dynamo_before"] and seen["dynamo_after"]
    # the imports' objects are out of the collector's generations, and far outnumber what is left
    assert seen["frozen"] > 100_000
    assert seen["tracked_young"] < seen["frozen"] / 10
