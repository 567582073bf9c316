"""What the vLLM engine hands vLLM, apart from the engine itself: engine arguments from a replica's
deployment spec (with a disaggregated deployment's kv_transfer_config), the weight backend's init
info, reading vLLM's per-token version spans, and recognising a request vLLM refused as retryable. Pure Python: no vLLM import (the CPU tests check these values
against vLLM's own serialization, tests/unit/inference_router/engine/test_vllm_backend.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from services.kit.config.recipe import DeploymentSpec

PAUSE_MODES = ("keep", "abort")
TRANSFER_BACKEND = "looprl"
WORKER_EXTENSION = "services.inference_router.engine.vllm_transfer.WorkerRegistration"
STATUS_RPC = "looprl_weight_status"  # WorkerRegistration's method: each rank's verdict


# vLLM's own default share of each GPU's memory, taken when a deployment asks for 0.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.85
# The ranks vLLM's LoRA config accepts as max_lora_rank (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that serves adapters of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"max_lora_rank: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, got {rank}")


def lora_request_args(run: str, version: int, int_id: int, path: str) -> dict[str, Any]:
    """LoRARequest keywords for version `version` of run `run`'s adapter, written at `path`: a new
    name and id per version, so vLLM loads it rather than reusing an adapter it cached."""
    return {"lora_name": f"{run}@{version}", "lora_int_id": int_id, "lora_path": path}


def engine_args(model_path: str, load_format: str, spec: DeploymentSpec) -> dict[str, Any]:
    """AsyncEngineArgs keywords for a replica of the deployment `spec`."""
    return {
        "model": model_path,
        "skip_tokenizer_init": True,
        "tensor_parallel_size": spec.tensor_parallel,
        "dtype": spec.serving_dtype,
        "max_model_len": spec.max_model_len,
        "max_num_seqs": spec.max_batch_size,
        "gpu_memory_utilization": spec.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        "load_format": load_format,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
        "weight_transfer_config": {"backend": TRANSFER_BACKEND},
        "enable_prefix_caching": True,
        "enforce_eager": spec.enforce_eager,
        **(
            {
                "enable_lora": True,
                "max_loras": spec.max_loras,
                "max_lora_rank": vllm_lora_rank(spec.max_lora_rank),
            }
            if spec.max_loras
            else {}
        ),
        **({"kv_transfer_config": kv} if (kv := kv_transfer_config(spec)) else {}),
    }


def kv_transfer_config(spec: DeploymentSpec) -> dict[str, Any] | None:
    """KVTransferConfig keywords for a worker of a disaggregated deployment (None otherwise).

    Every worker is "kv_both": vLLM takes a request's stage from its kv_transfer_params
    (do_remote_decode on the prefill instance, do_remote_prefill on the decode instance, which
    the router's two-phase request sets), so a tuned split moves a worker between stages without
    restarting it. A KV transfer that fails is recomputed on the decode worker rather than failing
    the request (kv_load_failure_policy = "recompute")."""
    pd = spec.disaggregation
    if pd is None:
        return None
    return {"kv_connector": pd.kv_connector, "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def nixl_environment(host: str, port: int) -> dict[str, str]:
    """Where a worker's NIXL side channel listens (its engine core reads these at start): the
    address other hosts reach it on, and a port of its own (several workers share a node)."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


def init_info_of(spec: DeploymentSpec) -> dict[str, Any]:
    """The backend's init info (LooprlInitInfo as a dict): the layout weight-sync plans for."""
    return {"tensor_parallel": spec.tensor_parallel, "naming": "fused", "dtype": spec.serving_dtype}


def token_versions_of(spans: Sequence[tuple[int, int, int]], count: int, fallback: int) -> list[int]:
    """Per-token versions from (version, start, end) spans of output-token indexes."""
    out = [fallback] * count
    for version, start, end in spans:
        for i in range(max(0, start), min(count, end)):
            out[i] = version
    return out


def is_retryable(exc: BaseException) -> bool:
    """vLLM's RetryableRequestError: a request added while an abort/wait pause is on."""
    return any(cls.__name__ == "RetryableRequestError" for cls in type(exc).__mro__)


async def admitted(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The stream's items; (None, None) once if vLLM refused the request as retryable before
    anything was sampled (the caller submits it again after the swap)."""
    first = True
    try:
        async for item in stream:
            first = False
            yield item
    except Exception as exc:
        if not (first and is_retryable(exc)):
            raise
        yield None, None
