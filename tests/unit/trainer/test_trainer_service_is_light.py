"""The trainer service process drives its ranks and never touches a tensor: it starts without torch,
which would cost ~2.5 s of CPU while every service of a stack comes up at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_trainer_service_starts_without_importing_torch() -> None:
    probe = "import sys, services.trainer.service; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
