"""A ready process's startup objects are frozen out of the garbage collector's scans, once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
SCRIPT = """
import gc, json
import torch  # what a service holds once started: torch, gRPC, protobuf
import grpc
from services.kit.process import gc_freeze
alive = len(gc.get_objects())
gc_freeze.freeze_startup_objects()
frozen = gc.get_freeze_count()
gc_freeze.freeze_startup_objects()  # a second ready state: nothing more is collected or frozen
print(json.dumps({"alive": alive, "frozen": frozen, "again": gc.get_freeze_count(),
                  "scanned": len(gc.get_objects())}))
"""


def test_a_ready_process_keeps_its_startup_objects_out_of_later_collections() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    )
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["frozen"] > 0.9 * counts["alive"] > 10_000
    assert counts["again"] == counts["frozen"]
    # What a later collection walks is what was allocated since, not the startup objects.
    assert counts["scanned"] < 0.01 * counts["frozen"]
