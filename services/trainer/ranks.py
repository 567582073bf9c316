"""The data-parallel rank group: N TrainerWorker Ray actors in one placement group and one
torch.distributed process group.

The driver (the trainer service, or a test) never touches tensors of the model; it only fans calls
out to every rank at once (collectives need all ranks) and gathers the answers. Rank 0 picks the
rendezvous port, the driver passes it to all ranks.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import Any

from services.kit.rpc import tls
from services.kit.telemetry import tracing as telemetry
from services.trainer.errors import RankLost
from services.trainer.spec import TrainerSpec

log = logging.getLogger("looprl.trainer.ranks")


class RankGroup:
    """Start with :meth:`start`; stop with :meth:`shutdown` (kills the actors, frees the bundles)."""

    def __init__(
        self,
        world_size: int,
        num_cpus_per_rank: float = 0.5,
        num_gpus_per_rank: float = 0.0,
        strategy: str = "PACK",
        resources_per_rank: dict[str, float] | None = None,
        threads_per_rank: int = 1,
        ready_timeout_s: float = 120.0,
        name: str = "",
    ) -> None:
        if world_size < 1:
            raise ValueError(f"trainer.world_size: must be >= 1, got {world_size}")
        self.world_size = world_size
        self.num_cpus_per_rank = num_cpus_per_rank
        self.num_gpus_per_rank = num_gpus_per_rank
        self.strategy = strategy
        self.resources_per_rank = dict(resources_per_rank or {})
        self.threads_per_rank = threads_per_rank
        self.ready_timeout_s = ready_timeout_s
        self.name = name
        """Prefix of the placement group's name in Ray (e.g. the run's), so `ray list placement-groups`
        says whose it is; each start adds its own suffix, as Ray refuses a name a live group holds."""
        self.actors: list[Any] = []
        self.pg: Any = None
        self.nodes: list[str] = []
        """The address of the Ray node each rank's bundle was reserved on, in rank order."""

    def start(self, spec: TrainerSpec) -> list[dict[str, Any]]:
        # Ray is imported late: it reads its auth settings from the environment at import time.
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundle()
        self.pg = placement_group(
            [dict(bundle) for _ in range(self.world_size)],
            strategy=self.strategy,
            name=f"{self.name}-{secrets.token_hex(4)}" if self.name else "",
        )
        try:
            ray.get(self.pg.ready(), timeout=self.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise RuntimeError(
                f"trainer placement group of {self.world_size} x {bundle} not placed within "
                f"{self.ready_timeout_s:.0f}s; the Ray cluster lacks resources"
            ) from None
        self.nodes = _bundle_nodes(self.pg)
        from services.trainer.worker import TrainerWorker  # torch: imported here, not in the service

        remote_cls = ray.remote(TrainerWorker)
        self.actors = [
            remote_cls.options(
                **self.worker_options(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank
                ),
            ).remote(
                rank, self.world_size, self.threads_per_rank, telemetry.exporter_settings(), tls.export()
            )
            for rank in range(self.world_size)
        ]
        host, port = ray.get(self.actors[0].rendezvous_address.remote(), timeout=self.ready_timeout_s)
        self.call("init_process_group", host, port)
        return self.call("setup", spec)

    def bundle(self) -> dict[str, float]:
        """One rank's placement-group bundle (pure, so CPU tests can check the GPU request)."""
        bundle: dict[str, float] = {"CPU": self.num_cpus_per_rank}
        if self.num_gpus_per_rank:
            bundle["GPU"] = self.num_gpus_per_rank
        # Custom resources (trainer.ray_resources_per_rank) in the bundle: a bundle is reserved only on a
        # node that offers them, so the recipe decides which nodes may hold ranks.
        bundle.update(self.resources_per_rank)
        return bundle

    def worker_options(self) -> dict[str, Any]:
        """A rank actor's Ray options, apart from its bundle index: what it takes of its bundle."""
        return {"num_cpus": self.num_cpus_per_rank, "num_gpus": self.num_gpus_per_rank, "max_concurrency": 1}

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """The same call on every rank at once; results in rank order."""
        refs = [getattr(actor, method).remote(*args, **kwargs) for actor in self.actors]
        return self._get(refs, timeout)

    def call_per_rank(
        self, method: str, per_rank_args: Sequence[Sequence[Any]], timeout: float | None = None
    ):
        """Rank r gets per_rank_args[r]; results in rank order."""
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"expected arguments for {self.world_size} ranks, got {len(per_rank_args)}")
        refs = [getattr(a, method).remote(*args) for a, args in zip(self.actors, per_rank_args, strict=True)]
        return self._get(refs, timeout)

    @staticmethod
    def _get(refs: list[Any], timeout: float | None) -> list[Any]:
        import ray

        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.RayActorError as exc:  # the process or its node is gone
            raise RankLost(_died(exc)) from None
        except ray.exceptions.RayTaskError as exc:
            # A rank's collective fails when its peer dies: the dead peer is the cause to report.
            lost = _lost_rank(refs)
            if lost is not None:
                raise RankLost(lost) from None
            # Surface the rank's own exception (BatchRejected, StepAborted, ...) to the caller.
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            raise cause from None

    # ---- conveniences over call() ----------------------------------------------------------------

    def train_step(self, batches_per_rank: Sequence[Sequence[Any]]) -> dict[str, Any]:
        results = self.call_per_rank("train_step", [(list(b),) for b in batches_per_rank])
        return _merge(results)

    def pull_and_train(
        self,
        packer_address: str,
        run_id: str,
        step: int,
        timeout_s: float = 0.0,
        push_address: str = "",
        trace_headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """One step on every rank; with push_address each rank then pushes its shards of the new
        version ("pushes": one result per rank)."""
        return _merge(
            self.call(
                "pull_and_train",
                packer_address,
                run_id,
                step,
                timeout_s,
                push_address=push_address,
                trace_headers=trace_headers,
            )
        )

    def push_weights(self, address: str, version: int) -> list[dict[str, Any]]:
        return self.call("push_weights", address, version)

    def save_checkpoint(self, root: str, extra: dict[str, Any] | None = None, keep: int = 3) -> str:
        return self.call("save_checkpoint", root, extra or {}, keep)[0]

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self.call("load_checkpoint", path)[0]

    def export_hf(self, directory: str, evaluated: Sequence[int] = (), keep: int = 0) -> str:
        return self.call("export_hf", directory, list(evaluated), keep)[0]

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.actors = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None


def _bundle_nodes(pg: Any) -> list[str]:
    """Where each bundle of `pg` is reserved (node addresses, bundle order): what says on which hosts
    the ranks run when the recipe places them (trainer.ray_resources_per_rank)."""
    import ray
    from ray.util.placement_group import placement_group_table

    try:
        by_bundle = placement_group_table(pg)["bundles_to_node_id"]
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return [address.get(by_bundle[i], "?") for i in sorted(by_bundle)]
    except Exception as exc:  # only for the log: never fail a start over it
        log.warning("could not tell where the trainer ranks run: %s", exc)
        return []


def _died(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def _lost_rank(refs: list[Any]) -> str | None:
    """Why a rank of this call died, if one did."""
    import ray

    for ref in refs:
        try:
            ray.get(ref, timeout=10)
        except ray.exceptions.RayActorError as exc:
            return _died(exc)
        except Exception:  # that rank failed otherwise; look at the next
            continue
    return None


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's all-reduced metrics plus the rollout ids of every rank."""
    merged = dict(results[0])
    merged["rollout_ids"] = [rid for r in results for rid in r.get("rollout_ids", [])]
    merged["rollout_traceparents"] = [t for r in results for t in r.get("rollout_traceparents", [])]
    merged.pop("push", None)
    if any("push" in r for r in results):
        merged["pushes"] = [r["push"] for r in results if "push" in r]
    return merged
