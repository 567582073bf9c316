"""OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions over the inference-router.

Agent frameworks and evaluators use the policy being trained through the official `openai` client.
`/v1/models` lists the policies a caller may use: each active run of the caller's tenant (by run id;
the newest run while none is active; an admin's: every tenant's) and each deployment the router
serves (by name) while the run it serves is one the caller may see: a run's own deployment
(DeploymentInfo.run_id) that run's, a deployment of the stack (no run_id) the newest active run's.
Another tenant's run is an unknown model, as if it did not exist. `model` picks one: a run id means
that run's tokenizer and chat template, and the router is asked for that run's own deployments
(GenerateRequest.run_id); a deployment name also pins the request to that deployment; an unknown
model is OpenAI's 404 `model_not_found`. Without `model` the request goes to the caller's one
active run (400 naming `model` when it may reach several), else to the stack's deployments if it may
use them; the reply's `model` is the run or deployment that served it. The endpoints tokenize, call
the router's Generate (GenerateStream for `stream: true`, sent as server-sent events) and decode.
`stop` strings end a choice at their first occurrence (finish_reason "stop"); `logprobs` report the
sampled tokens' log-probs (the engine returns no alternatives, so `top_logprobs` above 0 is refused).
`tools` are rendered by the run's chat template and the model's calls come back as `tool_calls`,
parsed as the environments that trained it parse them (gateway/openai_tools.py).
Every field is checked against its type and range before anything is forwarded, and one looprl does
not serve is refused naming it (gateway/openai_fields.py); errors are OpenAI-shaped.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from gateway.config import Tenant
from gateway.metrics import count_openai_tokens
from gateway.openai_fields import CHAT, COMPLETION, check_fields, identifiers, log_request
from gateway.openai_shapes import (
    Choice,
    best_of_n,
    bool_field,
    cache_session,
    chat_messages,
    choice_json,
    delta,
    int_field,
    logprobs_json,
    model_entry,
    sampling_values,
    stop_strings,
    stream_options,
)
from gateway.openai_tools import NO_TOOLS, ToolUse
from gateway.run_store import ACTIVE
from gateway.servicer import RunManager
from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.kit.config.limits import INT32_MAX
from services.kit.config.recipe import RecipeError
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.modeling.tokenizer import Tokenizer, TokenizerCache

DEPLOYMENTS_TTL_S = 5.0
# Key of the caller's tenant in an aiohttp request (set by the HTTP API's authentication).
TENANT = "looprl.tenant"


class OpenAIError(Exception):
    """An error with OpenAI's own code (e.g. model_not_found), not one derived from a gRPC status."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


@dataclass(frozen=True)
class Target:
    """What serves a request: the reply's `model` ("": the deployment that served it), the tokenizer,
    the deployment pinned ("" for none) and the run whose deployments serve it ("" for the stack's)."""

    label: str
    tokenizer: Tokenizer
    deployment: str
    run_id: str


class OpenAIEndpoints:
    def __init__(
        self,
        runs: RunManager,
        router: inference_pb2_grpc.InferenceRouterServiceStub | None,
        tokenizers: TokenizerCache,
    ) -> None:
        self.runs, self.router, self.tokenizers = runs, router, tokenizers
        self._run_tokenizers: dict[str, str] = {}  # run id -> its recipe's model.tokenizer (fixed)
        # When listed, and (name, run id or "" for the stack's) of each deployment the router serves.
        self._deployments: tuple[float, list[tuple[str, str]]] = (0.0, [])

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.list_models),
            web.get("/v1/models/{model}", self.get_model),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
        ]

    # ---- models -----------------------------------------------------------------------------------

    async def _policies(self, tenant: Tenant) -> tuple[list[Any], dict[str, Any], bool]:
        """(run records `tenant` may sample from; the deployments it may use, by name, each with the run
        it serves or None for the stack's; whether the policy the stack's deployments serve is one it
        may use). The stack's deployments serve the newest active run's policy (the newest run's while
        none is active): a tenant that may not see that run may not use them. A run's own deployment
        serves that run only."""
        records = await self.runs.store.list()
        serving = [r for r in records if r.state in ACTIVE] or records[-1:]
        runs = [r for r in serving if tenant.sees(r.tenant)]
        usable = not serving or tenant.sees(serving[-1].tenant)
        by_id = {r.run_id: r for r in records}
        deployments: dict[str, Any] = {}
        for name, run_id in await self._deployment_names():
            if not run_id:
                if usable:
                    deployments[name] = None
            elif run_id in by_id and tenant.sees(by_id[run_id].tenant):
                deployments[name] = by_id[run_id]
        return runs, deployments, usable

    async def _deployment_names(self) -> list[tuple[str, str]]:
        at, names = self._deployments
        if self.router is None or time.monotonic() - at < DEPLOYMENTS_TTL_S:
            return names
        try:
            reply = await self.router.ListDeployments(inference_pb2.ListDeploymentsRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"inference-router: cannot list deployments ({exc.details()})") from exc
        names = [(d.name, d.run_id) for d in reply.deployments]
        self._deployments = (time.monotonic(), names)
        return names

    async def list_models(self, request: web.Request) -> web.Response:
        runs, deployments, _ = await self._policies(request[TENANT])
        data = [model_entry(r.run_id, r.created_at, f"run {r.state}") for r in reversed(runs)]
        data += [model_entry(name, 0, "deployment") for name in deployments]
        return web.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        runs, deployments, _ = await self._policies(request[TENANT])
        for r in runs:
            if r.run_id == name:
                return web.json_response(model_entry(r.run_id, r.created_at, f"run {r.state}"))
        if name in deployments:
            return web.json_response(model_entry(name, 0, "deployment"))
        raise _not_found(name)

    async def _resolve(self, body: dict, tenant: Tenant) -> Target:
        """What serves the request's `model`: a run id (that run's own deployments, or the stack's
        while it has none of its own), a deployment name (pinned), or, without `model`, the caller's
        one active run. A caller that may reach several active runs must name one; one that may
        reach none samples the stack's deployments, if it may use them."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidArgument(f"model: must be a string, got {model!r}")
        if not model and self.router is None:
            # Nothing to pick a default among: the request is checked (the gateway's tokenizer)
            # and then answered UNAVAILABLE when it would be sent.
            return Target("", await self._tokenizer(None), "", "")
        runs, deployments, _ = await self._policies(tenant)
        if model:
            run = next((r for r in runs if r.run_id == model), None)
            if run is not None:
                return Target(model, await self._tokenizer(run), "", run.run_id)
            if model not in deployments:
                raise _not_found(model)
            owner = deployments[model]  # a run's own deployment serves that run only
            if owner is None:  # a deployment of the stack serves the newest run's policy
                return Target(model, await self._tokenizer(runs[-1] if runs else None), model, "")
            return Target(model, await self._tokenizer(owner), model, owner.run_id)
        active = [r for r in runs if r.state in ACTIVE]
        if len(active) > 1:
            names = ", ".join(r.run_id for r in active[-5:])
            raise InvalidArgument(
                f"model: required: {len(active)} runs you may sample from are active ({names}); "
                "name one (GET /v1/models lists them)"
            )
        if active:
            return Target(active[0].run_id, await self._tokenizer(active[0]), "", active[0].run_id)
        if not any(owner is None for owner in deployments.values()):
            # Unscoped, the router would take any deployment: another run's, maybe another tenant's.
            raise OpenAIError(
                404,
                "model: no model you may use is the default (see GET /v1/models)",
                "model_not_found",
                "model",
            )
        # The stack's deployments; the reply names the one that served it.
        return Target("", await self._tokenizer(runs[-1] if runs else None), "", "")

    async def _tokenizer(self, run: Any) -> Tokenizer:
        """The run's tokenizer (its recipe's model.tokenizer); the gateway's default without a run."""
        if run is None:
            return await self.tokenizers.aget()
        spec = self._run_tokenizers.get(run.run_id)
        try:
            if spec is None:
                spec = self._run_tokenizers[run.run_id] = run.recipe().model.tokenizer
            return await self.tokenizers.aget(spec)
        except (RecipeError, ValueError) as exc:
            raise FailedPrecondition(
                f"model: the tokenizer of run {run.run_id!r} does not load: {exc}"
            ) from exc

    # ---- requests ---------------------------------------------------------------------------------

    def _request(
        self, body: dict, ids: list[int], target: Target, tenant: Tenant, n: int = 0
    ) -> inference_pb2.GenerateRequest:
        """The router request; `n` (best_of) overrides the body's n."""
        values = sampling_values(body, self.runs.limits)
        if n:
            values["n"] = n
        sampling = common_pb2.SamplingParams(**values, stop_token_ids=[target.tokenizer.eos_token_id])
        return inference_pb2.GenerateRequest(
            prompt_token_ids=ids,
            sampling=sampling,
            request_id=uuid.uuid4().hex,
            deployment=target.deployment,
            run_id=target.run_id,
            session_id=cache_session(body, tenant.name),
        )

    def _check_ids(self, field: str, ids: list[int]) -> None:
        if not ids:
            raise InvalidArgument(f"{field}: must not be empty")
        longest = self.runs.limits.max_model_len
        if len(ids) > longest:
            raise InvalidArgument(f"{field}: {len(ids)} tokens, more than the longest model length {longest}")
        for i, token in enumerate(ids):
            if not 0 <= token <= INT32_MAX:
                raise InvalidArgument(f"{field}[{i}]: token id {token} is outside [0, {INT32_MAX}]")

    def _router(self) -> inference_pb2_grpc.InferenceRouterServiceStub:
        if self.router is None:
            raise Unavailable("no inference-router configured (LOOPRL_GATEWAY_ROUTER_ADDRESS)")
        return self.router

    async def _generate(self, request: inference_pb2.GenerateRequest, names: dict[str, str]) -> Any:
        try:
            return await self._router().Generate(request, timeout=120)
        except grpc.aio.AioRpcError as exc:
            raise _renamed(exc, names) from exc

    async def _stream(
        self, request: inference_pb2.GenerateRequest, names: dict[str, str]
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]:
        call = self._router().GenerateStream(
            inference_pb2.GenerateStreamRequest(request=request), timeout=120
        )
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as exc:
            raise _renamed(exc, names) from exc

    # ---- completions ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        check_fields(body, COMPLETION)
        target = await self._resolve(body, request[TENANT])
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = target.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise InvalidArgument("prompt: must be a string or a list of token ids")
        self._check_ids("prompt", ids)
        logprobs = int_field(body, "logprobs", 0, 0)
        echo = bool_field(body, "echo")
        if echo and logprobs is not None:
            raise InvalidArgument(
                "echo: with logprobs it needs the prompt's log-probs, which the engines do not return"
            )
        prefix = (prompt if isinstance(prompt, str) else target.tokenizer.decode(ids)) if echo else ""
        return await self._serve(request, body, COMPLETION, target, ids, "prompt", logprobs, prefix)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        check_fields(body, CHAT)
        target = await self._resolve(body, request[TENANT])
        tools = ToolUse.of(body)
        messages = chat_messages(body)
        try:
            ids = target.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tools=tools.tools
            )
        except ValueError as exc:  # the model's chat template refused the conversation
            raise InvalidArgument(f"messages: {exc}") from exc
        self._check_ids("messages", ids)
        want = bool_field(body, "logprobs")
        int_field(body, "top_logprobs", 0, 0)
        return await self._serve(
            request, body, CHAT, target, ids, "messages", 0 if want else None, tools=tools
        )

    async def _serve(
        self,
        http_request: web.Request,
        body: dict,
        kind: str,
        target: Target,
        ids: list[int],
        field: str,
        logprobs: int | None,
        prefix: str = "",
        tools: ToolUse = NO_TOOLS,
    ) -> web.StreamResponse:
        """Answer the request from the router. `prefix`: text every choice starts with (echo);
        `tools`: how a chat reply's tool calls are parsed."""
        stops = stop_strings(body)
        stream = bool_field(body, "stream")
        options = stream_options(body, stream)
        n, best_of = best_of_n(body, self.runs.limits, stream)
        tenant = http_request[TENANT]
        request = self._request(body, ids, target, tenant, n=best_of)
        names = {"prompt_token_ids": field}
        if body.get("max_completion_tokens") is not None:
            names["max_tokens"] = "max_completion_tokens"
        log_request(kind, tenant.name, target.label, identifiers(body))
        envelope = {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "created": int(time.time()), "model": target.label}
        streamable = tools.streamable if tools.parse else None
        choices = [Choice(target.tokenizer, stops, streamable) for _ in range(request.sampling.n)]
        if stream:
            return await self._sse(
                http_request, request, names, kind, envelope, choices, ids, logprobs, options, prefix, tools
            )
        reply = await self._generate(request, names)
        for choice, completion in zip(choices, reply.completions, strict=False):
            choice.add(list(completion.token_ids), list(completion.logprobs), completion.finish_reason)
        if best_of:  # the n with the highest log-prob per token, as OpenAI's best_of
            choices = sorted(choices, key=Choice.mean_logprob, reverse=True)[:n]
        out = [choice_json(kind, i, c, logprobs, prefix, tools) for i, c in enumerate(choices)]
        version = max((c.weight_version for c in reply.completions), default=0)
        usage = _usage(kind, ids, choices)
        envelope["model"] = target.label or reply.deployment  # what served it, never a guess
        return web.json_response(
            {**envelope, "object": kind, "choices": out, "usage": usage, "weight_version": version}
        )

    async def _sse(
        self,
        http_request: web.Request,
        request: inference_pb2.GenerateRequest,
        names: dict[str, str],
        kind: str,
        envelope: dict,
        choices: list[Choice],
        ids: list[int],
        logprobs: int | None,
        options: dict[str, bool],
        prefix: str,
        tools: ToolUse,
    ) -> web.StreamResponse:
        chunks = self._stream(request, names)
        first = await anext(chunks, None)  # router errors still become an HTTP status
        if not envelope["model"]:
            envelope["model"] = first.deployment if first is not None else ""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(http_request)
        obj = "chat.completion.chunk" if kind == CHAT else kind

        async def send(payload: dict | str) -> None:
            if not isinstance(payload, str):
                if options.get("include_obfuscation"):  # random padding: chunk sizes tell nothing
                    payload = {**payload, "obfuscation": secrets.token_urlsafe(1 + secrets.randbelow(24))}
                payload = json.dumps({**envelope, "object": obj, **payload})
            await response.write(f"data: {payload}\n\n".encode())

        for i in range(len(choices)):
            if kind == CHAT:
                await send(
                    {
                        "choices": [
                            {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        ]
                    }
                )
            elif prefix:
                await send({"choices": [delta(kind, i, prefix, None)]})
        done: set[int] = set()

        async def forward(chunk: inference_pb2.GenerateStreamResponse) -> None:
            if chunk.index >= len(choices) or chunk.index in done:
                return
            choice = choices[chunk.index]
            before = len(choice.ids)
            choice.add(list(chunk.token_ids), list(chunk.logprobs), chunk.finish_reason)
            calls = tools.final_delta(choice.text, choice.sent, choice.finish) if choice.finish else None
            if calls is not None:  # the reply ends in tool calls: they go out parsed, with the finish
                part = {"index": chunk.index, "delta": calls[0], "finish_reason": calls[1]}
                if logprobs is not None:
                    part["logprobs"] = logprobs_json(kind, choice.pieces(before))
                await send({"choices": [part]})
                done.add(chunk.index)
                return
            text = choice.pending_text(final=choice.finish is not None)
            if text or choice.finish:
                part = delta(kind, chunk.index, text, choice.finish)
                if logprobs is not None:
                    part["logprobs"] = logprobs_json(kind, choice.pieces(before))
                await send({"choices": [part]})
            if choice.finish:
                done.add(chunk.index)

        if first is not None:
            await forward(first)
        async for chunk in chunks:
            await forward(chunk)
        if options.get("include_usage"):
            await send({"choices": [], "usage": _usage(kind, ids, choices)})
        else:
            _usage(kind, ids, choices)  # counted in the metrics either way
        await send("[DONE]")
        await response.write_eof()
        return response


async def json_body(request: web.Request) -> dict:
    """The request's JSON object; INVALID_ARGUMENT naming `body` otherwise."""
    try:
        body = await request.json()
    except web.HTTPRequestEntityTooLarge:
        raise
    except Exception as exc:
        raise InvalidArgument(f"body: not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise InvalidArgument("body: must be a JSON object")
    return body


def _not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404, f"The model '{model}' does not exist (see GET /v1/models)", "model_not_found", "model"
    )


def _renamed(exc: grpc.aio.AioRpcError, names: dict[str, str]) -> Exception:
    """The router's INVALID_ARGUMENT in the request's own words: it names its fields
    (sampling.max_tokens, prompt_token_ids[3]); `names` maps them to the OpenAI field the caller set."""
    if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return exc
    detail = re.sub(r"^sampling\.", "", exc.details() or "")
    for ours, theirs in names.items():
        detail = re.sub(rf"^{ours}\b", theirs, detail)
    return InvalidArgument(detail)


def _usage(kind: str, ids: list[int], choices: list[Choice]) -> dict:
    completion = sum(len(c.ids) for c in choices)
    usage = {
        "prompt_tokens": len(ids),
        "completion_tokens": completion,
        "total_tokens": len(ids) + completion,
    }
    count_openai_tokens(kind, usage)
    return usage
