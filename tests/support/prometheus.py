"""A real Prometheus (and promtool) for tests: found on PATH, or installed from Debian's package
when the test runs as root with apt; otherwise None and the reason, so a test can fall back to
parsing scrapes in Python and say why."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from services.kit.local.infra import free_port

APT_PACKAGE = "prometheus"  # Debian 12: 2.42, ships promtool


def find_or_install(binary: str) -> tuple[str | None, str]:
    """The binary's path, or None and why it is not there."""
    found = shutil.which(binary)
    if found:
        return found, ""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None, f"{binary} not on PATH and apt-get is not usable here (not root or no apt)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", APT_PACKAGE]
    try:
        done = subprocess.run(install, capture_output=True, text=True, timeout=300, env=env)
        if done.returncode != 0:
            subprocess.run(["apt-get", "update"], capture_output=True, timeout=300, env=env)
            done = subprocess.run(install, capture_output=True, text=True, timeout=300, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"apt-get install {APT_PACKAGE} failed: {exc}"
    found = shutil.which(binary)
    return (found, "") if found else (None, f"apt-get install {APT_PACKAGE}: {done.stderr.strip()[-300:]}")


def check_metrics(promtool: str, exposition: str) -> str:
    """promtool's lint findings for one /metrics text ("" when clean)."""
    done = subprocess.run(
        [promtool, "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=30
    )
    return "" if done.returncode == 0 else (done.stdout + done.stderr).strip()


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def _get(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as reply:
            body = json.loads(reply.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's series (vector results; a scalar counts as one series)."""
        data = self._get("/api/v1/query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def exemplars(self, expr: str, start: float, end: float) -> list[dict]:
        return self._get("/api/v1/query_exemplars", query=expr, start=str(start), end=str(end))


@contextmanager
def running(
    binary: str,
    targets: Mapping[str, str],
    state_dir: Path,
    interval_s: float = 1.0,
    discovered: Mapping[str, str] | None = None,
) -> Iterator[Prometheus]:
    """Prometheus scraping `targets` (job -> host:port) every interval_s, exemplars kept, and the
    targets HTTP service discovery finds (`discovered`: job -> SD url, e.g. the router's /targets)."""
    jobs = "\n".join(
        f"  - job_name: {job}\n    static_configs: [{{targets: ['{address}']}}]"
        for job, address in targets.items()
    )
    for job, url in (discovered or {}).items():
        jobs += f"\n  - job_name: {job}\n    http_sd_configs: [{{url: '{url}', refresh_interval: 1s}}]"
    state_dir.mkdir(parents=True, exist_ok=True)
    config = state_dir / "prometheus.yml"
    every = f"{round(interval_s * 1000)}ms"
    config.write_text(
        f"global:\n  scrape_interval: {every}\n  scrape_timeout: {every}\nscrape_configs:\n{jobs}\n"
    )
    port = free_port()
    with open(state_dir / "prometheus.log", "w") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={state_dir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--enable-feature=exemplar-storage",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    prometheus = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{prometheus.url}/-/ready", timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"prometheus did not start: {(state_dir / 'prometheus.log').read_text()[-500:]}"
                    ) from None
                time.sleep(0.2)
        yield prometheus
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
