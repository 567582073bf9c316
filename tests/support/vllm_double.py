"""A recording stand-in for vLLM's AsyncLLM (vllm/v1/engine/async_llm.py), for CPU tests.

Only the methods the looprl engine calls exist, each with AsyncLLM's exact signature (a test
compares them with the pinned source, `async_llm_signatures`). What vLLM would do across its
processes is done for real where it can be: every utility call's arguments go through vLLM's
own msgpack encoder and the engine core's untyped decoder (vllm/v1/serial_utils.py), and the
weight-transfer calls reach one real looprl backend per TP rank (built by vLLM's real factory on
a small module holding vLLM's fused parameter names), each given its own entry of the per-rank
update list as vLLM's worker picks it. Scheduling, KV cache and generation are not simulated:
`reset_prefix_cache` answers what the scheduler would (False while requests hold KV unless told
to preempt them, and a raise where even preempting them cannot free the cache).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
from types import SimpleNamespace
from typing import Any

import torch

from services.modeling.layouts import Layout, rank_params
from tests.support import vllm_side


def async_llm_signatures() -> dict[str, tuple[bool, inspect.Signature]]:
    """AsyncLLM's methods in the pinned vLLM, read from its source (the class cannot be imported
    beside our torch): name -> (is async, signature with defaults as source text)."""
    tree = ast.parse(vllm_side.source("vllm/v1/engine/async_llm.py"))
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AsyncLLM"]
    out = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        a = fn.args
        params = []
        positional = a.posonlyargs + a.args
        defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
        for arg, default in zip(positional, defaults, strict=True):
            kind = (
                inspect.Parameter.POSITIONAL_ONLY
                if arg in a.posonlyargs
                else inspect.Parameter.POSITIONAL_OR_KEYWORD
            )
            params.append(_param(arg.arg, kind, default))
        if a.vararg:
            params.append(inspect.Parameter(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
        for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
            params.append(_param(arg.arg, inspect.Parameter.KEYWORD_ONLY, default))
        if a.kwarg:
            params.append(inspect.Parameter(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
        out[fn.name] = (isinstance(fn, ast.AsyncFunctionDef), inspect.Signature(params))
    return out


def _param(name: str, kind: Any, default: ast.expr | None) -> inspect.Parameter:
    value = inspect.Parameter.empty if default is None else ast.unparse(default)
    return inspect.Parameter(name, kind, default=value)


def normalized(fn: Any) -> tuple[bool, inspect.Signature]:
    """A double's method as (is async, signature with defaults as source text)."""
    sig = inspect.signature(fn)
    params = [
        p.replace(
            annotation=inspect.Parameter.empty,
            default=p.default if p.default is inspect.Parameter.empty else repr(p.default),
        )
        for p in sig.parameters.values()
    ]
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn), inspect.Signature(params)


class FusedModel(torch.nn.Module):
    """A worker's model as far as the weight backend sees it: vLLM's fused parameter names and
    this rank's shard shapes (rank_params of the fused layout)."""

    def __init__(self, config, layout: Layout, rank: int) -> None:
        super().__init__()
        for p in rank_params(config, layout, rank):
            *path, leaf = p.name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            param = torch.nn.Parameter(torch.zeros(p.shape, dtype=layout.torch_dtype), requires_grad=False)
            module.register_parameter(leaf, param)


class RecordingAsyncLLM:
    """Records every call in order; forwards weight-transfer calls to one real backend per rank."""

    def __init__(self, config, layout: Layout, reset_results: tuple[bool, ...] = ()) -> None:
        serial = vllm_side.load("vllm.v1.serial_utils")
        factory = vllm_side.load("vllm.distributed.weight_transfer.factory")
        wt_config = vllm_side.load("vllm.config.weight_transfer")
        import services.inference_router.engine.vllm_transfer  # noqa: F401 - registers "looprl"

        self.encoder, self.decoder = serial.MsgpackEncoder(), serial.MsgpackDecoder()
        self.utility_result = serial.UtilityResult
        self.result_decoder = serial.MsgpackDecoder(serial.UtilityResult)
        self.calls: list[tuple[str, Any]] = []
        self.workers = []
        for rank in range(layout.tp_size):
            vllm_config = SimpleNamespace(
                parallel_config=SimpleNamespace(
                    tensor_parallel_size=layout.tp_size,
                    rank=rank,
                    data_parallel_index=0,
                    world_size=layout.tp_size,
                ),
                model_config=SimpleNamespace(dtype=layout.torch_dtype),
            )
            self.workers.append(
                factory.WeightTransferEngineFactory.create_engine(
                    wt_config.WeightTransferConfig(backend="looprl"),
                    vllm_config,
                    torch.device("cpu"),
                    FusedModel(config, layout, rank),
                )
            )
        self.reset_results = list(reset_results)
        self.weight_version: str | None = None
        self.fail_update: str = ""  # a phase whose update_weights raises on rank `fail_rank`
        self.fail_rank = 0
        self.prompts: list[list[int]] = []
        self.lora_requests: list[object] = []  # the lora_request of each generate call
        self.kv_params: list[dict[str, Any] | None] = []  # each request's kv_transfer_params
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._abort_epoch = 0
        self._abort_paused = False

    def _utility(self, method: str, *args: Any) -> tuple:
        """The arguments as the engine core receives them (core_client._call_utility_async
        encodes (client_index, call_id, method, args); core.py decodes without a type)."""
        frames = self.encoder.encode((0, 1, method, args))
        _, _, decoded_method, decoded_args = self.decoder.decode(frames)
        assert decoded_method == method
        self.calls.append((method, decoded_args))
        return tuple(decoded_args)

    def _collective(self, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        _, _, _args, decoded = self._utility("collective_rpc", method, None, (), kwargs)
        return decoded

    # -- AsyncLLM's methods, same signatures as vllm 0.33 (checked by the tests) --
    async def init_weight_transfer_engine(self, request) -> None:
        kwargs = self._collective("init_weight_transfer_engine", {"init_info": request.init_info})
        for w in self.workers:
            w.init_transfer_engine(w.parse_init_info(kwargs["init_info"]))

    async def pause_generation(self, *, mode="abort", clear_cache=True) -> None:
        self._utility("pause_generation", mode, clear_cache)
        self._unpaused.clear()
        if mode == "abort":
            self._abort_epoch += 1
            self._abort_paused = True

    async def resume_generation(self) -> None:
        self._utility("resume_scheduler")
        self._unpaused.set()
        self._abort_paused = False

    async def generate(
        self,
        prompt,
        sampling_params,
        request_id,
        *,
        prompt_text=None,
        lora_request=None,
        tokenization_kwargs=None,
        trace_headers=None,
        priority=0,
        data_parallel_rank=None,
        session_id=None,
        kv_hints=None,
        reasoning_ended=None,
        reasoning_parser_kwargs=None,
    ):
        """One token per step (n=1), each labelled, as vLLM's engine core does, with the version
        set when that step ran, and its log-prob -(version + 1) so a test can tell which weights
        produced it. Paused steps wait; an abort-mode pause ends the request with "abort"."""
        ids = list(prompt["prompt_token_ids"])
        self.prompts.append(ids)
        self.lora_requests.append(lora_request)
        kv = (getattr(sampling_params, "extra_args", None) or {}).get("kv_transfer_params")
        self.kv_params.append(kv)
        if self._abort_paused:  # vLLM rejects new requests during an abort/wait pause
            raise RetryableRequestError("Request failed; please retry")
        epoch, starts, count = self._abort_epoch, [], 0
        while True:
            await asyncio.sleep(0.001)
            if self._abort_epoch != epoch:
                yield _output([], [], "abort", _spans(starts, count))
                return
            if not self._unpaused.is_set():
                continue
            version = self.weight_version or "0"
            if not starts or starts[-1][0] != version:
                starts.append((version, count))
            token, count = (len(ids) + count) % 50, count + 1
            done = count >= sampling_params.max_tokens
            yield _output(
                [token],
                [-(int(version) + 1.0)],
                "length" if done else None,
                _spans(starts, count) if done else None,
                _handed_over(request_id, len(ids)) if done and kv and kv.get("do_remote_decode") else None,
            )
            if done:
                return

    async def start_weight_update(self) -> None:
        self._utility("collective_rpc", "start_weight_update", None, (), None)
        for w in self.workers:
            w.start_weight_update()

    async def update_weights(self, request) -> None:
        kwargs = self._collective("update_weights", {"update_info": request.update_info})
        infos = kwargs["update_info"]
        failed = ""
        # collective_rpc runs on every worker at once: a rank that raises does not stop the others
        # (they load their shards), and the client sees the failure after all of them returned.
        for rank, w in enumerate(self.workers):
            info = infos[rank] if isinstance(infos, list) else infos  # as gpu_worker.update_weights picks
            if self.fail_update and info["phase"] == self.fail_update and rank == self.fail_rank:
                w.active = False  # vLLM closes a worker's session when its update raises
                failed = f"rank {rank} failed in phase {info['phase']}"
                continue
            w.update_weights(info)
        if failed:
            raise RuntimeError(failed)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        """Only looprl's worker extension method: each rank's report, as vLLM returns a utility
        result to the client (encoded on the engine core, decoded typed as UtilityResult)."""
        from services.inference_router.engine.vllm_transfer import WorkerRegistration

        self._utility("collective_rpc", method, timeout, args, kwargs)
        reports = []
        for w in self.workers:
            worker = WorkerRegistration()
            worker.weight_transfer_engine = w
            reports.append(getattr(worker, method)(*args, **(kwargs or {})))
        return self.result_decoder.decode(self.encoder.encode(self.utility_result(reports))).result

    async def finish_weight_update(self, weight_version=None) -> None:
        self._utility("collective_rpc", "finish_weight_update", None, (), None)
        inactive = [w for w in self.workers if not w.active]
        for w in self.workers:
            if w.active:
                w.finish_weight_update()
        if inactive:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        if weight_version is not None:
            await self.update_weight_version(weight_version)

    async def update_weight_version(self, new_version) -> None:
        (version,) = self._utility("set_weight_version", new_version)
        self.weight_version = version

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False) -> bool:
        """The next scripted result (True once the script runs out). A False that preempting
        running requests could not avoid is raised, as vLLM 0.33's scheduler does
        (scheduler.py reset_prefix_cache), and reaches the client as the plain Exception
        core_client makes of a failed utility call."""
        self._utility("reset_prefix_cache", reset_running_requests, reset_connector)
        ok = self.reset_results.pop(0) if self.reset_results else True
        if not ok and reset_running_requests:
            raise Exception(
                "Call to reset_prefix_cache method failed: Failed to reset KV cache even when all "
                "the running requests are preempted and moved to the waiting queue."
            )
        return ok

    def shutdown(self, timeout=None) -> None:
        self.calls.append(("shutdown", ()))

    # -- for assertions --
    def names(self) -> list[str]:
        return [m if m != "collective_rpc" else f"rpc:{args[0]}" for m, args in self.calls]

    def served(self, rank: int) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.workers[rank].model.named_parameters()}


class RetryableRequestError(Exception):
    """Named as vllm.exceptions.RetryableRequestError, which the engine recognises by name."""


def _spans(starts: list[tuple[str, int]], count: int) -> list[SimpleNamespace]:
    ends = [start for _, start in starts[1:]] + [count]
    return [SimpleNamespace(version=v, start=s, end=e) for (v, s), e in zip(starts, ends, strict=True)]


def _handed_over(request_id: str, prompt_tokens: int) -> dict[str, Any]:
    """What NixlConnector's prefill side answers a do_remote_decode request with (the keys of
    vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py request_finished; a test
    checks them against that source)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[0, 1]],
        "remote_engine_id": "engine-p",
        "remote_request_id": request_id,
        "remote_host": "10.0.0.7",
        "remote_port": 5601,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": prompt_tokens,
        "remote_blocks_expiry_time": 30.0,
        "remote_registration_generation": 0,
        "transfer_mode": "pull",
    }


def _output(tokens, logprobs, finish, spans, kv_transfer_params=None) -> SimpleNamespace:
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logprobs, strict=True)]
    comp = SimpleNamespace(
        index=0, token_ids=tokens, logprobs=steps, finish_reason=finish, weight_versions=spans
    )
    return SimpleNamespace(outputs=[comp], kv_transfer_params=kv_transfer_params)
