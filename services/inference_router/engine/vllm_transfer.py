"""looprl's weight delivery as a vLLM weight-transfer backend ("looprl"), run inside each vLLM worker.

vLLM 0.33 drives weight updates through `vllm.distributed.weight_transfer`: the engine calls
`init_weight_transfer_engine`, then per version `start_weight_update`, `update_weights` (any
number of times) and `finish_weight_update`; each worker runs the matching method of the
`WeightTransferEngine` that `WeightTransferEngineFactory` built from `weight_transfer_config`.
This module is that engine for looprl. Importing it registers it with the factory; the vLLM
engine names `WorkerRegistration` as its `worker_extension_cls`, which every worker process
imports before it loads the model, so the backend exists wherever vLLM looks it up.

Each worker receives its OWN TP rank's resharded rectangles (vLLM's fused names and shard
shapes, as weight-sync planned them for this rank): `update_weights` gets a list indexed by
worker rank, and vLLM hands every worker its own entry. Every version is applied in two calls:
phase "verify" maps the rank's tensors (services/inference_router/engine/vllm_handoff.py), checks
each against its hash64 and the worker's own parameters and writes nothing; the engine then asks
every worker for its verdict (`collective_rpc("looprl_weight_status")`, the one method
`WorkerRegistration` adds) and only when every rank verified does phase "load" copy them into the
model. A corrupt or mismatched version therefore never touches the served weights. The verify
phase records a failure instead of raising it: vLLM's multiprocess executor stops reading the
other ranks' replies at the first failed one, which would leave their replies queued for the
next call. The model's parameters are written in place, so start/finish only guard the session.

Imports vLLM: load it only where vLLM is installed (the vLLM workers; tests load vLLM's pure
Python sources for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from services.inference_router.engine.vllm_handoff import (
    UpdateReader,
    check_against,
    load_into,
    vocab_rows_start,
)
from services.weights.errors import InvalidWeights

BACKEND = "looprl"


@dataclass
class LooprlInitInfo(WeightTransferInitInfo):
    """What every worker checks once: the layout weight-sync plans for (TP degree, naming, dtype)."""

    tensor_parallel: int
    naming: str
    dtype: str


@dataclass
class LooprlUpdateInfo(WeightTransferUpdateInfo):
    """One rank's part of one version (fields: vllm_handoff.UPDATE_FIELDS)."""

    version: int
    phase: str
    transport: str
    params: list
    segment: str = ""
    handles: list | None = None


class LooprlWeightTransferEngine(WeightTransferEngine[LooprlInitInfo, LooprlUpdateInfo]):
    init_info_cls = LooprlInitInfo
    update_info_cls = LooprlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.layout: LooprlInitInfo | None = None
        self.verified_version: int | None = None
        self.loaded_version: int | None = None
        self.active = False
        self.last_error = ""

    def init_transfer_engine(self, init_info: LooprlInitInfo) -> None:
        tp = int(getattr(self.parallel_config, "tensor_parallel_size", 1))
        if init_info.tensor_parallel != tp:
            raise InvalidWeights(
                f"init_info.tensor_parallel: weight-sync plans for tp={init_info.tensor_parallel}, "
                f"this vLLM engine runs tp={tp}"
            )
        if init_info.naming != "fused":
            raise InvalidWeights(f"init_info.naming: vLLM holds 'fused' names, got {init_info.naming!r}")
        served = str(getattr(self.model_config, "dtype", init_info.dtype)).removeprefix("torch.")
        if served != init_info.dtype:
            raise InvalidWeights(f"init_info.dtype: this vLLM engine serves {served}, got {init_info.dtype}")
        self.layout = init_info

    def start_weight_update(self) -> None:
        if self.layout is None:
            raise InvalidWeights("start_weight_update: init_weight_transfer_engine was never called")
        self.active, self.verified_version = True, None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's update_weights, synchronizing only an accelerator device (a CPU worker has none)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: LooprlUpdateInfo) -> None:
        if not self.active:
            raise InvalidWeights("update_weights: outside start_weight_update/finish_weight_update")
        info = {k: v for k, v in vars(update_info).items() if v is not None}
        reader = UpdateReader(info, self.device)
        try:
            params = dict(self.model.named_parameters())
            if update_info.phase == "verify":
                try:
                    check_against(params, update_info.params, self._vocab_starts())
                    reader.tensors(verify=True)  # every hash checked; nothing written
                except InvalidWeights as exc:  # ChecksumMismatch too: reported, see the module doc
                    self.verified_version, self.last_error = None, str(exc)
                    return
                self.verified_version, self.last_error = update_info.version, ""
                return
            if self.verified_version != update_info.version:
                raise InvalidWeights(
                    f"update_info.phase: version {update_info.version} must be verified before it is loaded"
                )
            load_into(params, reader.tensors(verify=False))
            self.loaded_version = update_info.version
        finally:
            reader.close()

    def report(self) -> dict[str, Any]:
        """This rank's verdict on the update in progress (msgpack-native)."""
        verified = -1 if self.verified_version is None else int(self.verified_version)
        loaded = -1 if self.loaded_version is None else int(self.loaded_version)
        return {"verified": verified, "loaded": loaded, "error": self.last_error}

    def finish_weight_update(self) -> None:
        self.active, self.verified_version = False, None

    def shutdown(self) -> None:
        self.active, self.layout = False, None

    def _vocab_starts(self) -> dict[str, int]:
        out = {}
        for prefix, module in self.model.named_modules():
            start = vocab_rows_start(module)
            if start is not None:
                out[f"{prefix}.weight" if prefix else "weight"] = start
        return out


def register() -> None:
    """Register the backend with vLLM's factory (idempotent: once per process)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, LooprlWeightTransferEngine)


class WorkerRegistration:
    """vLLM's worker_extension_cls: importing it (every worker does, before loading the model)
    registered the backend; its one method reports the backend's verdict to the engine."""

    def looprl_weight_status(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, LooprlWeightTransferEngine):
            return {
                "verified": -1,
                "loaded": -1,
                "error": "the looprl weight-transfer backend is not configured",
            }
        return engine.report()


register()
