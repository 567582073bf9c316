"""Ray helpers: join the configured Ray head (or start a private local one), one namespace per service."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("looprl.ray")


_CONNECTING = threading.Lock()


def connect_ray(address: str, namespace: str, num_cpus: int | None = None) -> None:
    """ray.init once per process. An empty address starts a private local Ray (tests, laptops).

    Token auth (on by default in Ray 2.60) is taken from RAY_AUTH_MODE/RAY_AUTH_TOKEN in the
    environment, which `looprl up` exports to every service it starts. A joined head is watched:
    when it is lost the process restarts itself once a new one is up (services/kit/ray/head_loss.py).
    """
    import ray

    from services.kit.ray import head_loss as ray_head

    # Several threads may connect at once (the router starts each run's deployments in its own).
    with _CONNECTING:
        if ray.is_initialized():
            return
        kwargs: dict = {"namespace": namespace, "logging_level": "ERROR", "log_to_driver": False}
        address = address or os.environ.get("RAY_ADDRESS", "")
        if address:
            ray.init(address=address, **kwargs)
            ray_head.joined(address)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, **kwargs)
    log.info("connected to ray", extra={"fields": {"address": address or "local", "namespace": namespace}})


def disconnect_ray() -> None:
    import ray

    from services.kit.ray import head_loss as ray_head

    if ray.is_initialized():
        ray.shutdown()
    ray_head.left()


def cluster_resources() -> tuple[dict[str, float], dict[str, float]]:
    """(total, in use) of every alive node's resources, from the joined cluster; RuntimeError while
    no node is alive (a head just started registers its own node seconds later)."""
    import ray

    total = {name: float(v) for name, v in ray.cluster_resources().items()}
    if not total:
        raise RuntimeError("no Ray node is alive yet")
    free = ray.available_resources()
    return total, {name: max(amount - float(free.get(name, 0.0)), 0.0) for name, amount in total.items()}
