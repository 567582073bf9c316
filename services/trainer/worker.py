"""One data-parallel trainer rank: the FSDP2-sharded policy, its optimizer, and the step.

Plain Python so it can be driven directly (a single process) or as a Ray actor (ranks.py wraps it).
Every public method that touches the model is *collective*: all ranks must call it together, with
the same number of micro-batches, or the FSDP all-gathers would hang. Bad input is therefore judged
collectively too: each rank validates its own batches, the ranks all-reduce a verdict, and either all
of them train or all of them raise, before any forward pass.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import grpc
import torch
import torch.distributed as dist
from opentelemetry import context as otel_context

from looprl.packer.v1 import packer_pb2, packer_pb2_grpc
from looprl.weightsync.v1 import weightsync_pb2_grpc
from services.kit.process import gc_freeze
from services.kit.process.hosts import interface_of, node_address
from services.kit.rpc import tls
from services.kit.rpc.interceptors import traced_channel
from services.kit.telemetry import tracing as telemetry
from services.modeling import causal_lm, lora
from services.modeling.logprobs import token_logprobs
from services.trainer.batch import PackedMicroBatch, from_proto, validate_rank_batches
from services.trainer.errors import BatchRejected, PushFailed, StepAborted
from services.trainer.loss import LossMetrics
from services.trainer.optim import build_optimizer
from services.trainer.shards import push_requests
from services.trainer.spec import TrainerSpec, shards_layers
from services.trainer.step import StepSettings, accumulate, apply_gradients, micro_batch_loss

log = logging.getLogger("looprl.trainer.worker")

_OK, _BAD_BATCH, _PULL_FAILED = 0, 1, 2


class TrainerWorker:
    def __init__(
        self,
        rank: int,
        world_size: int,
        threads: int | None = None,
        tracing: dict[str, str] | None = None,
        tls_credentials: dict[str, Any] | None = None,
    ) -> None:
        # Spans of this rank (its packer and weight-sync calls) go where the trainer service's go.
        telemetry.setup_from_settings("trainer", tracing)
        if tls_credentials is not None:
            tls.adopt(tls_credentials)  # calls the packer and weight-sync as the trainer
        self.rank = rank
        self.world_size = world_size
        torch.set_num_threads(threads or int(os.environ.get("LOOPRL_TRAINER_THREADS", "1")))
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.spec: TrainerSpec | None = None
        self.model: Any = None
        self.ref_model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.step = 0  # steps trained == current weight version
        self.last_packer_step = -1
        self.mesh: Any = None
        self._channels: dict[tuple[str, int], grpc.Channel] = {}

    def _channel(self, address: str, max_message_bytes: int) -> grpc.Channel:
        """One channel per peer for the worker's lifetime: a new one every step costs a TCP and HTTP/2
        handshake twice a step (packer, weight-sync). gRPC reconnects a cached channel by itself when
        the peer restarts on the same address (within a second: services/kit/rpc/tls.py)."""
        key = (address, max_message_bytes)
        channel = self._channels.get(key)
        if channel is None:
            options = tls.message_limits(max_message_bytes)
            channel = self._channels[key] = traced_channel(tls.sync_channel(address, options))
        return channel

    def _forget_channel(self, address: str, max_message_bytes: int) -> None:
        """After a failed call: the next one starts from a fresh connection."""
        channel = self._channels.pop((address, max_message_bytes), None)
        if channel is not None:
            channel.close()

    # ---- process group ---------------------------------------------------------------------------

    def rendezvous_address(self) -> tuple[str, int]:
        """Called on rank 0: an address the other ranks can reach and a port free right now. In Ray
        that is the node's address: 127.0.0.1 for a local head, a reachable one on a cluster."""
        import ray

        from services.kit.local.infra import free_port

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        return host, free_port()

    def init_process_group(self, host: str, port: int, timeout_s: float = 600.0) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            backend = "gloo"
            # gloo binds the interface of the host name's address unless told: on a machine (or
            # namespace host) whose name resolves elsewhere the other ranks could not connect.
            ifname = "lo" if host == "127.0.0.1" else interface_of(node_address())
            if ifname:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    def shutdown(self, barrier_timeout_s: float = 10.0) -> None:
        """Leave the group together: rank 0 serves the rendezvous store, and a rank still tearing
        down its gloo pairs when rank 0 has exited dies in C++ ("terminate called")."""
        telemetry.flush()
        if not dist.is_initialized():
            return
        if dist.get_backend() == dist.Backend.GLOO:  # NCCL has no barrier that ends on a timeout
            try:  # a peer already gone ends the wait at the timeout
                dist.monitored_barrier(timeout=timedelta(seconds=barrier_timeout_s))
            except RuntimeError:
                pass
        dist.destroy_process_group()

    # ---- model -----------------------------------------------------------------------------------

    def setup(self, spec: TrainerSpec) -> dict[str, Any]:
        """(Re)build the policy, the optimizer and the schedule from the spec; step back to 0."""
        self.spec = spec
        self.model = self._build_model(spec)
        self.ref_model = None
        if spec.recipe.algorithm.kl_coef > 0:
            self.ref_model = self._build_model(spec)
            self.ref_model.requires_grad_(False)
            self.ref_model.eval()
        # Only what trains: all of the model, or a LoRA run's adapters (the base is frozen).
        self.optimizer, self.scheduler = build_optimizer(
            [p for p in self.model.parameters() if p.requires_grad], spec.recipe.optimizer, spec.total_steps
        )
        self.step = 0
        self.last_packer_step = -1
        gc_freeze.freeze_startup_objects()
        params = sum(p.numel() for p in self.model.parameters())
        return {"rank": self.rank, "parameters": params, "device": str(self.device)}

    def _build_model(self, spec: TrainerSpec) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model_section = spec.recipe.model
        if model_section.path:
            model = causal_lm.load(model_section.path, model_section.implementation, dtype=torch.float32)
        else:
            # Identical on every rank: the init draws from its own seeded generator.
            model = causal_lm.build(spec.model_config(), spec.recipe.run.seed, model_section.init_std)
        if model_section.lora is not None:  # the same seeded adapter init on every rank
            lora.inject(model, lora.spec_of(model_section.lora), seed=spec.recipe.run.seed)
        model = model.to(self.device)
        kwargs: dict[str, Any] = {"mesh": self.mesh}
        # model.dtype is the compute dtype (mixed precision on GPU); master weights stay float32.
        if self.device.type == "cuda" and model_section.dtype == "bfloat16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        elif self.world_size == 1:
            # Nothing to shard: FSDP's hooks and DTensor dispatch would only slow every step down (a
            # large share of a tiny model's step on CPU: bench/step_timeline.py). Pushes,
            # checkpoints and grads handle plain tensors.
            return model
        if shards_layers(spec, sum(p.numel() for p in model.parameters())):
            for layer in causal_lm.decoder_layers(model):
                fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    # ---- batches ---------------------------------------------------------------------------------

    @staticmethod
    def _decode(batch: Any) -> PackedMicroBatch:
        if isinstance(batch, PackedMicroBatch):
            return batch
        if isinstance(batch, bytes):
            batch = packer_pb2.MicroBatch.FromString(batch)
        return from_proto(batch)

    def _agree(self, batches: list[Any], expected_step: int | None, failure: str | None = None):
        """Decode + validate locally, then agree across ranks; returns the decoded batches or raises."""
        status, error, decoded = _OK, failure, []
        if failure is not None:
            status = _PULL_FAILED
        else:
            try:
                decoded = [self._decode(b) for b in batches]
                step = expected_step if expected_step is not None else (decoded[0].step if decoded else 0)
                validate_rank_batches(decoded, step, self.vocab_size)
            except BatchRejected as exc:
                status, error = _BAD_BATCH, str(exc)
        norm = (decoded[0].global_loss_tokens, decoded[0].global_sequences) if decoded else (0, 0)
        verdict = torch.tensor(
            [status, len(batches), -len(batches), norm[0], -norm[0], norm[1], -norm[1]], dtype=torch.int64
        )
        verdict = self._all_reduce(verdict, dist.ReduceOp.MAX)
        worst = int(verdict[0])
        if worst != _OK:
            errors: list[Any] = [None] * self.world_size
            dist.all_gather_object(errors, error)
            detail = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            if worst == _PULL_FAILED:
                raise StepAborted(f"step {expected_step} aborted, nothing applied: {detail}")
            raise BatchRejected(f"step rejected, nothing applied: {detail}")
        if int(verdict[1]) != -int(verdict[2]):
            raise BatchRejected(
                f"micro_batches: ranks received between {-int(verdict[2])} and {int(verdict[1])} micro-batches; "
                "FSDP needs the same count on every rank (the packer must balance counts)"
            )
        if int(verdict[3]) != -int(verdict[4]) or int(verdict[5]) != -int(verdict[6]):
            raise BatchRejected(
                "micro_batches.global_loss_tokens: ranks disagree on the step's global token/sequence counts"
            )
        return decoded

    def _all_reduce(self, value: torch.Tensor, op: Any) -> torch.Tensor:
        if self.world_size == 1:  # a lone rank's value is the reduction; gloo would only add latency
            return value
        moved = value.to(self.device)
        dist.all_reduce(moved, op=op)
        return moved.cpu()

    # ---- the step --------------------------------------------------------------------------------

    def train_step(self, batches: list[Any], pull_failure: str | None = None) -> dict[str, Any]:
        """Train one step on this rank's micro-batches (gradient accumulation), clip, AdamW, schedule."""
        assert self.spec is not None, "setup() first"
        start = time.perf_counter()
        expected = self.step
        decoded = self._agree(batches, expected, pull_failure)
        spec = self.spec
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # FSDP averages gradients over ranks; each micro-batch's share is a fraction of the global sum.
        step = accumulate(
            self.model,
            [mb.to(self.device) for mb in decoded],
            self._step_settings(),
            expected,
            self.ref_model,
            loss_scale=self.world_size,
        )
        grad_norm, skipped, lr = apply_gradients(
            self.model, self.optimizer, self.scheduler, spec.recipe.optimizer.grad_clip
        )
        if skipped:
            log.warning("non-finite gradient norm; step %d skipped", expected)
        sums, local_tokens, max_staleness = step.metrics, step.tokens, step.max_staleness
        self.step = expected + 1
        self.last_packer_step = expected

        totals = self._all_reduce(
            torch.cat([sums.as_tensor(), torch.tensor([float(local_tokens)], dtype=torch.float64)]),
            dist.ReduceOp.SUM,
        )
        maxima = self._all_reduce(
            torch.cat([torch.tensor([float(max_staleness)], dtype=torch.float64), sums.maxima_tensor()]),
            dist.ReduceOp.MAX,
        )
        max_staleness = int(maxima[0])
        result = LossMetrics.from_tensor(totals[:-1]).finalize(maxima[1:])
        seconds = time.perf_counter() - start
        result.update(
            step=expected,
            version=self.step,
            grad_norm=grad_norm,
            lr=lr,
            skipped=skipped,
            num_tokens=float(totals[-1]),
            tokens_per_second=float(totals[-1]) / max(seconds, 1e-9),
            step_seconds=seconds,
            max_staleness=max_staleness,
            rollout_ids=[rid for mb in decoded for rid in mb.rollout_ids],
            reward_mean=decoded[0].step_reward_mean if decoded else 0.0,
            reward_std=decoded[0].step_reward_std if decoded else 0.0,
        )
        return result

    def _step_settings(self) -> StepSettings:
        recipe = self.spec.recipe
        return StepSettings(recipe.algorithm, recipe.sampling.temperature, self.spec.loss_max_tokens)

    def pull_and_train(
        self,
        packer_address: str,
        run_id: str,
        step: int,
        timeout_s: float = 0.0,
        max_message_bytes: int = 256 << 20,
        push_address: str = "",
        trace_headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Pull this rank's micro-batches of `step` from the packer, train on them, and (with
        push_address) push the new version's shards to weight-sync in the same call: one actor
        round trip less on every step's critical path. A failed push does not undo the step; it
        comes back as "push" = {"error": ...}. trace_headers: the trainer's step span, so this
        rank's calls are in the step's trace."""
        token = otel_context.attach(telemetry.extract(trace_headers)) if trace_headers else None
        try:
            metrics = self._pull_and_train(
                packer_address, run_id, step, timeout_s, max_message_bytes, push_address
            )
        finally:
            if token is not None:
                otel_context.detach(token)
        return metrics

    def _pull_and_train(
        self,
        packer_address: str,
        run_id: str,
        step: int,
        timeout_s: float,
        max_message_bytes: int,
        push_address: str,
    ) -> dict[str, Any]:
        batches: list[Any] = []
        failure = None
        started = time.perf_counter()
        try:
            stub = packer_pb2_grpc.RolloutPackerServiceStub(self._channel(packer_address, max_message_bytes))
            request = packer_pb2.NextBatchRequest(
                run_id=run_id,
                step=step,
                rank=self.rank,
                world_size=self.world_size,
                trainer_version=self.step,
                timeout_seconds=timeout_s,
            )
            for response in stub.NextBatch(request):
                batches.append(response.micro_batch)
        except grpc.RpcError as exc:
            self._forget_channel(packer_address, max_message_bytes)
            failure = f"NextBatch from {packer_address}: {exc.code().name} {exc.details()}"
        pulled = time.perf_counter()
        metrics = self.train_step(batches, pull_failure=failure)
        metrics["rollout_traceparents"] = [t for b in batches for t in b.rollout_traceparents if t]
        trained = time.perf_counter()
        metrics["phase_seconds"] = {"pull": pulled - started, "train": trained - pulled}
        if push_address:
            try:
                metrics["push"] = self.push_weights(push_address, self.step)
            except Exception as exc:  # the step is applied either way; the caller decides
                metrics["push"] = {"rank": self.rank, "version": self.step, "error": repr(exc)}
            metrics["phase_seconds"]["push"] = time.perf_counter() - trained
        return metrics

    # ---- inspection (no update) ------------------------------------------------------------------

    @torch.no_grad()
    def forward_logprobs(self, batches: list[Any]) -> list[torch.Tensor]:
        """Log-probs of each micro-batch's tokens under the current policy (collective)."""
        decoded = [self._decode(b) for b in batches]
        self.model.eval()
        out = []
        for mb in decoded:
            mb = mb.to(self.device)
            logits = self.model(mb.input_ids, mb.position_ids, mb.cu_seqlens)
            out.append(
                token_logprobs(
                    logits, mb.input_ids, mb.cu_seqlens, self.spec.recipe.sampling.temperature
                ).cpu()
            )
        return out

    @torch.no_grad()
    def evaluate_loss(self, batches: list[Any]) -> dict[str, float]:
        """The step loss on these batches without updating anything (validated like a step)."""
        decoded = self._agree(batches, None)
        self.model.eval()
        sums = LossMetrics()
        for mb in decoded:
            _, metrics = micro_batch_loss(
                self.model, mb.to(self.device), self._step_settings(), self.step, self.ref_model
            )
            sums.add(metrics)
        return LossMetrics.from_tensor(self._all_reduce(sums.as_tensor(), dist.ReduceOp.SUM)).finalize()

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor] | None:
        """The gathered model state dict (collective; for export and tests, never on the hot path)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
        sd = get_model_state_dict(self.model, options=options)
        if rank0_only and self.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in sd.items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Gathered gradients of the last step (collective; tests compare them with a reference)."""
        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                out[name] = grad.detach().cpu()
        return out

    # ---- weights out -----------------------------------------------------------------------------

    def _config_json(self) -> str:
        """What a version is: the model's config.json, or for a LoRA run its adapter's config (its
        versions carry the adapter's tensors only)."""
        import json

        config = self.model.config
        section = self.spec.recipe.model.lora
        if section is not None:
            config = config.with_lora(lora.spec_of(section))
        return json.dumps(config.to_hf_dict())

    @property
    def _adapters_only(self) -> bool:
        return self.spec.recipe.model.lora is not None

    def _push_dtype(self) -> torch.dtype | None:
        from services.kit.messages.codec import torch_dtype

        return torch_dtype(self.spec.push_dtype) if self.spec.push_dtype else None

    def shard_requests(self, version: int, max_bytes: int | None = None) -> list[bytes]:
        """This rank's PushShards stream for `version`, serialized (tests reassemble these)."""
        return [
            r.SerializeToString()
            for r in push_requests(
                self.model,
                version,
                self.rank,
                self.world_size,
                self.spec.run_id,
                max_bytes or self.spec.push_max_bytes,
                self._push_dtype(),
                self._config_json(),
                self._adapters_only,
            )
        ]

    def push_weights(self, address: str, version: int, timeout_s: float = 300.0) -> dict[str, Any]:
        """Stream this rank's own shards of `version` to weight-sync (client streaming)."""
        max_bytes = self.spec.push_max_bytes
        limit = max_bytes + (4 << 20)
        start = time.perf_counter()
        stub = weightsync_pb2_grpc.WeightSyncServiceStub(self._channel(address, limit))
        requests = push_requests(
            self.model,
            version,
            self.rank,
            self.world_size,
            self.spec.run_id,
            max_bytes,
            self._push_dtype(),
            self._config_json(),
            self._adapters_only,
        )
        try:
            response = stub.PushShards(requests, timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                self._forget_channel(address, limit)
                # A gRPC error does not pickle: Ray would hand the caller its own error instead.
                raise PushFailed(
                    f"PushShards to weight-sync at {address}: {exc.code().name}: {exc.details()}"
                ) from None
            # e.g. after a resume, weight-sync already holds this version from before the crash.
            return {
                "rank": self.rank,
                "version": version,
                "bytes": 0,
                "complete": False,
                "skipped": exc.details(),
                "seconds": time.perf_counter() - start,
            }
        return {
            "rank": self.rank,
            "version": response.version,
            "bytes": response.bytes_received,
            "complete": response.version_complete,
            "seconds": time.perf_counter() - start,
        }

    # ---- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self, directory: str, extra: dict[str, Any] | None = None, keep: int = 3) -> str:
        from services.trainer.checkpoint import save

        return save(self, directory, extra or {}, keep=keep)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        from services.trainer.checkpoint import load

        return load(self, path)

    def export_hf(self, directory: str, evaluated: Sequence[int] = (), keep: int = 0) -> str:
        from services.trainer.checkpoint import export_hf

        return export_hf(self, directory, evaluated, keep)

    def state(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "last_packer_step": self.last_packer_step}
