"""Which deployments may serve a request, by its run.

- A run's own deployments are those whose `run_id` is the run's: the ones started from its record
  (named `<run id>/<name>`) and static ones configured for it. A request of run R goes only there.
- A run with none of its own falls back to the stack's shared deployments (`run_id` empty), as in
  the single-run mode; while its own are still starting it waits for them instead.
- A request without a run goes to the shared deployments, or to any when there are none.
- A pinned deployment name is read as the run's own (`<run id>/<name>`) first, then as given; a
  request may not pin another run's deployment.

Pure bookkeeping (no I/O): the router asks, the run watcher (runs.py) tells it what is starting.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from services.inference_router.policies import DeploymentState
from services.kit.config.recipe import run_deployment_name
from services.kit.rpc.errors import InvalidArgument


class RunScope:
    def __init__(self) -> None:
        # run id -> the deployment names being started for it (not yet routable or not yet added)
        self.starting: dict[str, set[str]] = {}
        # run id -> why its deployments could not start (requests fail with it, not fall back)
        self.failed: dict[str, str] = {}

    def begin(self, run_id: str, names: Iterable[str]) -> None:
        self.starting[run_id] = set(names)
        self.failed.pop(run_id, None)

    def started(self, run_id: str) -> None:
        self.starting.pop(run_id, None)

    def fail(self, run_id: str, why: str) -> None:
        self.starting.pop(run_id, None)
        self.failed[run_id] = why

    def forget(self, run_id: str) -> None:
        self.starting.pop(run_id, None)
        self.failed.pop(run_id, None)

    def loading(self, deployments: Mapping[str, DeploymentState], run_id: str) -> bool:
        """Run `run_id`'s deployments are being started, or none of their replicas served yet."""
        if not run_id:
            return False
        if run_id in self.starting:
            return True
        return any(d.for_run and d.run_id == run_id and not d.ever_routable for d in deployments.values())

    def candidates(self, deployments: Mapping[str, DeploymentState], run_id: str) -> list[DeploymentState]:
        """The deployments an unpinned request of `run_id` may go to (empty: none yet)."""
        if not run_id:
            shared = [d for d in deployments.values() if not d.for_run]
            return shared or list(deployments.values())
        own = [d for d in deployments.values() if d.run_id == run_id]
        if own or run_id in self.starting:
            return own
        return [d for d in deployments.values() if not d.run_id]

    def resolve(self, deployments: Mapping[str, DeploymentState], run_id: str, pinned: str) -> str:
        """The deployment a request of `run_id` pinning `pinned` means; InvalidArgument naming
        `deployment` when it is unknown or another run's."""
        if run_id:
            scoped = run_deployment_name(run_id, pinned)
            if scoped in deployments or scoped in self.starting.get(run_id, ()):
                return scoped
        dep = deployments.get(pinned)
        if dep is not None:
            owner = dep.run_id
        else:
            # Named by its full name while it starts.
            owner = next((r for r, names in self.starting.items() if pinned in names), None)
            if owner is None:
                known = ", ".join(sorted(deployments)) or "none"
                raise InvalidArgument(f"deployment: unknown deployment {pinned!r} (known: {known})")
        if run_id and owner and owner != run_id:
            raise InvalidArgument(
                f"deployment: {pinned!r} serves run {owner!r}, not this request's run {run_id!r}"
            )
        return pinned
