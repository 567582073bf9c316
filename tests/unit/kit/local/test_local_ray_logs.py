"""A stopped local Ray head leaves its sessions' logs with the stack and nothing in /tmp."""

from __future__ import annotations

import shutil
from pathlib import Path

from services.kit.local.infra import keep_ray_logs, ray_temp_dir

PORT = 64999  # a port no test head uses: heads bind 6379 or 27000-28000


def session(temp_dir: Path, name: str, log: str) -> Path:
    logs = temp_dir / name / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text(log)
    (temp_dir / name / "sockets").mkdir()
    return temp_dir / name


def test_every_session_of_a_restarted_head_is_kept_and_tmp_is_cleared(tmp_path: Path) -> None:
    temp_dir = ray_temp_dir(PORT)
    try:
        session(temp_dir, "session_2026-12-03_10-00-00_1", "before the restart: GCS lost")
        latest = session(temp_dir, "session_2026-12-03_10-05-00_2", "after the restart")
        (temp_dir / "session_latest").symlink_to(latest)
        keep_ray_logs(PORT, tmp_path)
        kept = tmp_path / "ray-logs"
        assert sorted(p.name for p in kept.iterdir()) == [
            "session_2026-12-03_10-00-00_1",
            "session_2026-12-03_10-05-00_2",
        ]
        assert (
            kept / "session_2026-12-03_10-00-00_1" / "raylet.out"
        ).read_text() == "before the restart: GCS lost"
        assert not temp_dir.exists()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_head_that_never_started_a_session_leaves_nothing(tmp_path: Path) -> None:
    keep_ray_logs(PORT, tmp_path)
    assert not (tmp_path / "ray-logs").exists() and not ray_temp_dir(PORT).exists()
