"""Dockerfiles and the container health probe.

The images are checked as text (no docker daemon here): one target per service running its module,
non-root, a gRPC health check, CPU torch pinned from the lock, and nothing COPY'd that is missing
or excluded from the build context. deploy/healthcheck.py is run against a real gRPC health server.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.kit.config import registry

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "deploy/docker/Dockerfile"
GPU_DOCKERFILE = ROOT / "deploy/docker/inference-router.gpu.Dockerfile"
HEALTHCHECK = ROOT / "deploy/healthcheck.py"
STACK = {s.name: s.package for s in registry.SERVICES}  # name -> package
ROOT_ALLOWED = {"environment-sandbox"}  # per-worker uids and namespaces; see deploy/README.md


def stages(path: Path) -> dict[str, list[str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if match:
            current = match.group(2) or f"_{len(out)}"
            out[current] = [f"FROM {match.group(1)}"]
        elif current is not None:
            out[current].append(line)
    return out


def chain(all_stages: dict[str, list[str]], name: str) -> list[str]:
    """Instructions of a stage including those inherited from the stages it builds FROM."""
    lines = all_stages[name]
    parent = lines[0].split()[1]
    return (chain(all_stages, parent) if parent in all_stages else []) + lines[1:]


def last(lines: list[str], instruction: str) -> str | None:
    found = [line for line in lines if line.split()[0].upper() == instruction]
    return found[-1][len(instruction) :].strip() if found else None


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        pattern = pattern.lstrip("/")
        if pattern.startswith("**/"):
            if fnmatch.fnmatch(Path(path).name, pattern[3:]):
                return True
        elif path == pattern or path.startswith(pattern + "/") or fnmatch.fnmatch(path, pattern):
            return True
    return False


def copied_sources(path: Path) -> list[str]:
    sources = []
    for lines in stages(path).values():
        for line in lines:
            if line.upper().startswith("COPY") and "--from" not in line:
                parts = [p for p in line.split()[1:] if not p.startswith("--")]
                sources += parts[:-1]
    return sources


@pytest.mark.parametrize("name", sorted(STACK))
def test_each_service_has_a_target_running_its_module_through_the_entrypoint(name):
    all_stages = stages(DOCKERFILE)
    assert name in all_stages, f"no `FROM runtime AS {name}` stage in {DOCKERFILE}"
    entrypoint = json.loads(last(chain(all_stages, name), "ENTRYPOINT"))
    assert entrypoint == ["tini", "--", "looprl-entrypoint", STACK[name]]
    assert importlib.util.find_spec(f"{STACK[name]}.__main__") is not None


@pytest.mark.parametrize("name", sorted(STACK))
def test_service_images_run_as_a_non_root_user_unless_documented(name):
    user = last(chain(stages(DOCKERFILE), name), "USER")
    assert user is not None
    uid = user.split(":")[0]
    if name in ROOT_ALLOWED:
        assert uid in ("0", "root")
        assert "environment-sandbox" in (ROOT / "deploy/README.md").read_text()
    else:
        assert uid not in ("0", "root") and int(uid) >= 1000, f"{name} runs as {user}"


@pytest.mark.parametrize("path", [DOCKERFILE, GPU_DOCKERFILE], ids=["cpu-image", "cuda-image"])
def test_images_health_check_through_grpc_health_and_bind_every_interface(path):
    lines = [line for lines in stages(path).values() for line in lines]
    healthcheck = (
        last(lines, "HEALTHCHECK")
        if path == GPU_DOCKERFILE
        else last(chain(stages(path), "trainer"), "HEALTHCHECK")
    )
    assert healthcheck and "looprl-healthcheck" in healthcheck
    env = " ".join(line for line in lines if line.upper().startswith("ENV"))
    for setting in ("LOOPRL_HOST=0.0.0.0", "LOOPRL_GRPC_PORT=50051", "LOOPRL_METRICS_PORT=9464"):
        assert setting in env, f"{path.name} must set {setting}"


@pytest.mark.parametrize("path", [DOCKERFILE, GPU_DOCKERFILE], ids=["cpu-image", "cuda-image"])
def test_everything_copied_exists_and_is_inside_the_build_context(path):
    patterns = dockerignore()
    for source in copied_sources(path):
        assert (ROOT / source).exists(), f"{path.name} copies {source}, which does not exist"
        assert not ignored(source, patterns), f"{path.name} copies {source}, but .dockerignore excludes it"


def test_dockerignore_matcher_really_excludes():
    patterns = dockerignore()
    assert ignored(".venv", patterns) and ignored("tests/unit/x.py", patterns)
    assert not ignored("services", patterns)


def test_cpu_image_takes_torch_from_the_cpu_index_at_the_locked_version():
    text = DOCKERFILE.read_text()
    assert "download.pytorch.org/whl/cpu" in text
    assert "grep -E '^torch==' requirements.lock" in text
    assert re.search(r"^torch==\S+$", (ROOT / "requirements.lock").read_text(), re.MULTILINE)
    assert "pip install -c requirements.lock ." in text


def test_gpu_image_installs_vllm_from_its_requirements_and_runs_the_router():
    text = GPU_DOCKERFILE.read_text()
    assert (ROOT / "requirements/vllm.txt").is_file()
    assert "requirements/vllm.txt" in text
    assert "pip install --no-deps ." in text
    all_stages = stages(GPU_DOCKERFILE)
    final = list(all_stages)[-1]
    assert json.loads(last(chain(all_stages, final), "ENTRYPOINT"))[-2:] == [
        "looprl-entrypoint",
        "services.inference_router",
    ]
    assert last(chain(all_stages, final), "USER").split(":")[0] == "10001"
    assert "deploy/docker/inference-router.gpu.Dockerfile" in (ROOT / "pyproject.toml").read_text()


# --- deploy/healthcheck.py against a real grpc.health.v1 server -----------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_healthcheck():
    spec = importlib.util.spec_from_file_location("looprl_healthcheck", HEALTHCHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def health_server():
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


def test_healthcheck_passes_only_while_serving(health_server, capsys):
    servicer, port = health_server
    probe = load_healthcheck()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert probe.main(["--port", str(port)]) == 1
    assert "NOT_SERVING" in capsys.readouterr().out
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert probe.main(["--port", str(port)]) == 0
    servicer.set("looprl.trainer.v1.TrainerService", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert probe.main(["--port", str(port), "--service", "looprl.trainer.v1.TrainerService"]) == 1


def test_healthcheck_fails_when_nothing_listens_and_refuses_a_missing_port(capsys):
    probe = load_healthcheck()
    assert probe.main(["--port", str(free_port()), "--timeout", "1"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().out
    assert probe.main(["--port", ""]) == 2
    assert probe.main(["--port", "0"]) == 2


def test_healthcheck_reads_the_port_the_service_reads(health_server):
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    result = subprocess.run(
        [sys.executable, str(HEALTHCHECK)],
        env={"LOOPRL_GRPC_PORT": str(port), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("SERVING")


# --- deploy/docker/entrypoint.sh: join the Ray cluster, run the module, forward SIGTERM, leave ----

ENTRYPOINT = ROOT / "deploy/docker/entrypoint.sh"
SERVICE_STUB = """
import os, signal, sys, time
print("started", sys.argv[1:], os.environ.get("LOOPRL_ON_RAY_HEAD_LOSS"), flush=True)
lost = os.environ.get("HEAD_LOST_ONCE")
if lost and not os.path.exists(lost):  # the first run loses its Ray head
    open(lost, "w").close()
    sys.exit(75)
def stop(*_):
    print("drained", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(os.environ["READY_FILE"], "w").close()
while True:
    time.sleep(0.05)
"""


def entrypoint_env(tmp_path: Path, ray_address: str) -> dict[str, str]:
    (tmp_path / "fake_service.py").write_text(SERVICE_STUB)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A stand-in for the `ray` CLI that only records how it was called (no cluster in unit tests).
    (bin_dir / "ray").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/ray-calls\n')
    (bin_dir / "ray").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHONPATH": str(tmp_path),
        "READY_FILE": str(tmp_path / "ready"),
        "LOOPRL_RAY_ADDRESS": ray_address,
    }


def run_until_ready_then_sigterm(tmp_path: Path, env: dict[str, str]) -> tuple[int, str]:
    import time

    proc = subprocess.Popen(
        ["sh", str(ENTRYPOINT), "fake_service", "--flag"], env=env, stdout=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 20
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "service never started"
        time.sleep(0.05)
    proc.terminate()
    out, _ = proc.communicate(timeout=20)
    return proc.returncode, out


def test_entrypoint_joins_the_cluster_without_resources_forwards_sigterm_and_leaves(tmp_path):
    env = entrypoint_env(tmp_path, "ray-head:6379")
    code, out = run_until_ready_then_sigterm(tmp_path, env)
    assert "started ['--flag'] exit" in out and "drained" in out, out
    assert code == 0
    calls = (tmp_path / "ray-calls").read_text().splitlines()
    assert calls[0].startswith("start --address=ray-head:6379 --num-cpus=0 --num-gpus=0")
    assert calls[-1] == "stop --force"


def test_entrypoint_rejoins_the_cluster_and_restarts_a_service_that_lost_its_ray_head(tmp_path):
    env = entrypoint_env(tmp_path, "ray-head:6379") | {"HEAD_LOST_ONCE": str(tmp_path / "lost")}
    code, out = run_until_ready_then_sigterm(tmp_path, env)
    assert out.count("started ['--flag'] exit") == 2 and "drained" in out, out
    assert code == 0
    calls = [c.split()[0] for c in (tmp_path / "ray-calls").read_text().splitlines()]
    assert calls == ["start", "stop", "start", "stop"]


@pytest.mark.parametrize("address", ["", "ray://head:10001"])
def test_entrypoint_without_a_cluster_address_just_runs_the_service(tmp_path, address):
    env = entrypoint_env(tmp_path, address)
    code, out = run_until_ready_then_sigterm(tmp_path, env)
    assert "drained" in out and code == 0
    assert not (tmp_path / "ray-calls").exists()


def test_healthcheck_presents_the_services_certificate_to_a_mutual_tls_server(tmp_path, monkeypatch, capsys):
    from services.kit.rpc import tls

    pki = tls.generate_dev_pki(tmp_path / "tls", ["trainer"])
    creds = tls.Credentials.from_dir("trainer", pki)
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = tls.add_port(server, "127.0.0.1:0", creds)
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        probe = load_healthcheck()
        assert probe.main(["--port", str(port), "--timeout", "2"]) == 1  # no certificate: refused
        monkeypatch.setenv("LOOPRL_TLS_CA_FILE", str(pki / "ca.crt"))
        monkeypatch.setenv("LOOPRL_TLS_CERT_FILE", str(pki / "trainer.crt"))
        monkeypatch.setenv("LOOPRL_TLS_KEY_FILE", str(pki / "trainer.key"))
        assert probe.main(["--port", str(port), "--timeout", "5"]) == 0
        assert "SERVING" in capsys.readouterr().out
        monkeypatch.delenv("LOOPRL_TLS_KEY_FILE")
        assert probe.main(["--port", str(port)]) == 2  # half-configured TLS is a misconfiguration
    finally:
        server.stop(None)
