"""A trainer rank leaves its process group cleanly on either backend: gloo ranks meet at a barrier
first, and a rank on NCCL (which has no barrier with a timeout) goes straight to teardown instead of
failing in torch's gloo-only monitored_barrier. Runs one real gloo rank in this process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from services.kit.local.infra import free_port
from services.trainer.worker import TrainerWorker


def test_a_gloo_rank_shuts_down_and_leaves_no_group_behind():
    worker = TrainerWorker(rank=0, world_size=1, threads=torch.get_num_threads())
    worker.init_process_group("127.0.0.1", free_port())
    worker.shutdown(barrier_timeout_s=2)
    assert not dist.is_initialized()


def test_a_rank_on_nccl_skips_the_gloo_only_barrier_and_still_tears_down(monkeypatch):
    worker = TrainerWorker(rank=0, world_size=1, threads=torch.get_num_threads())
    worker.init_process_group("127.0.0.1", free_port())
    torn_down = []
    real_destroy = dist.destroy_process_group

    def destroy(*args, **kwargs):
        monkeypatch.undo()  # the real teardown of the real (gloo) group, under its real backend
        torn_down.append(True)
        real_destroy(*args, **kwargs)

    # torch itself (c10d.monitored_barrier) refuses any backend but gloo: report NCCL to both views
    monkeypatch.setattr(dist, "get_backend", lambda group=None: dist.Backend.NCCL)
    monkeypatch.setattr(c10d, "get_backend", lambda group=None: dist.Backend.NCCL)
    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    worker.shutdown(barrier_timeout_s=2)
    assert torn_down and not dist.is_initialized()
