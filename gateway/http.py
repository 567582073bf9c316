"""HTTP/JSON API: runs, and an OpenAI-compatible /v1/completions and /v1/chat/completions.

The OpenAI-compatible endpoints tokenize, forward to the inference-router's Generate and
decode, so agent frameworks and evaluators can use the policy being trained. They tokenize with the
tokenizer of the model the router serves: the newest run's (its recipe's `model.tokenizer`, with its
chat template; a stack serves one run at a time), or the gateway's default while there is no run. Every route but
/healthz needs a bearer token. Every request field is checked against its type and range before
anything is forwarded (OPENAI_FIELDS). Errors use OpenAI's {"error": {"message", "type", "param",
"code"}} shape with the HTTP status that matches the gRPC one; `param` names the offending field.
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from typing import Any

import grpc
from aiohttp import web
from google.protobuf.json_format import MessageToDict

from gateway.auth import TokenAuth
from gateway.metrics import count_openai_tokens, http_metrics, init_routes
from gateway.runs import ACTIVE
from gateway.service import RunManager, run_to_proto
from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.kit.errors import FailedPrecondition, InvalidArgument, ServiceError, Unavailable
from services.kit.limits import INT32_MAX, INT64_MAX
from services.kit.recipe import RecipeError
from services.modeling.tokenizer import Tokenizer, TokenizerCache

log = logging.getLogger("looprl.gateway.http")

# Largest request body: room for a recipe at the largest recipe limit plus JSON escaping.
MAX_BODY_BYTES = 4 << 20

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 412,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


# OpenAI's error type by HTTP status; 5xx is "server_error".
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}

# The OpenAI request fields forwarded as SamplingParams: (kind, default, smallest, largest); a str
# largest names the gateway's RecipeLimits field (the same cluster limit a recipe is held to).
# OpenAI's own ranges where it has one (temperature [0, 2], top_p [0, 1], n <= 128).
OPENAI_FIELDS: dict[str, tuple[type, float, float, float | str]] = {
    "temperature": (float, 1.0, 0.0, 2.0),
    "top_p": (float, 1.0, 0.0, 1.0),
    "max_tokens": (int, 16, 1, "max_tokens"),
    "n": (int, 1, 1, 128),
    "seed": (int, 0, 0, INT64_MAX),
}

_FIELD = re.compile(r"^([A-Za-z_]\w*)[\w.\[\]]*: ")


def _error(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status
    )


def _param(message: str) -> str | None:
    """The top-level request field a "field[...]: what" message names."""
    match = _FIELD.match(message)
    return match.group(1) if match else None


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ServiceError as exc:
        status = HTTP_STATUS.get(exc.code, 500)
        return _error(status, exc.message, exc.code.name, _param(exc.message) if status == 400 else None)
    except grpc.aio.AioRpcError as exc:
        return _error(HTTP_STATUS.get(exc.code(), 502), exc.details() or "", exc.code().name)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.text or exc.reason, exc.reason.upper().replace(" ", "_"))
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, "internal error (logged by the gateway)", "INTERNAL")


def _sampling_value(body: dict, name: str, limits: Any) -> Any:
    """One OPENAI_FIELDS field of the body, checked; InvalidArgument names it otherwise."""
    kind, default, low, high = OPENAI_FIELDS[name]
    value = body.get(name)
    if value is None:  # absent or null: OpenAI's default
        return default
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidArgument(f"{name}: must be an integer, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name}: must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(f"{name}: must be a finite number, got {value!r}")
    largest = getattr(limits, high) if isinstance(high, str) else high
    if not low <= value <= largest:
        raise InvalidArgument(f"{name}: must be in [{low}, {largest}], got {value!r}")
    return kind(value)


def _run_json(run) -> dict:
    return MessageToDict(run, preserving_proto_field_name=True)


class HttpApi:
    def __init__(
        self,
        runs: RunManager,
        auth: TokenAuth,
        router: inference_pb2_grpc.InferenceRouterServiceStub | None,
        tokenizers: TokenizerCache,
    ) -> None:
        self.runs, self.auth, self.router, self.tokenizers = runs, auth, router, tokenizers
        self._run_tokenizers: dict[str, str] = {}  # run id -> its recipe's model.tokenizer (fixed)

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[http_metrics, _errors, self._authenticate], client_max_size=MAX_BODY_BYTES
        )
        app.add_routes(
            [
                web.get("/healthz", self.healthz),
                web.post("/v1/runs", self.create_run),
                web.get("/v1/runs", self.list_runs),
                web.get("/v1/runs/{run_id}", self.get_run),
                web.post("/v1/runs/{run_id}/stop", self.stop_run),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
            ]
        )
        init_routes(app)
        return app

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/healthz":
            self.auth.check(request.headers.get("Authorization"))
        return await handler(request)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            raise
        except Exception as exc:
            raise InvalidArgument(f"body: not valid JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise InvalidArgument("body: must be a JSON object")
        return body

    async def create_run(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body.get("recipe_toml"), str):
            raise InvalidArgument("recipe_toml: required string")
        record = await self.runs.create(body["recipe_toml"], str(body.get("run_id", "")))
        return web.json_response(_run_json(run_to_proto(record)), status=201)

    async def list_runs(self, request: web.Request) -> web.Response:
        runs = [_run_json(await self.runs.proto(r)) for r in await self.runs.store.list()]
        return web.json_response({"runs": runs})

    async def get_run(self, request: web.Request) -> web.Response:
        return web.json_response(
            _run_json(await self.runs.proto(await self.runs.get(request.match_info["run_id"])))
        )

    async def stop_run(self, request: web.Request) -> web.Response:
        return web.json_response(
            _run_json(await self.runs.proto(await self.runs.stop(request.match_info["run_id"])))
        )

    async def _tokenizer(self) -> Tokenizer:
        """The tokenizer of the model the router serves: the newest active run's (else the newest
        run's), the gateway's default while there is none."""
        records = await self.runs.store.list()
        records = [r for r in records if r.state in ACTIVE] or records
        if not records:
            return await self.tokenizers.aget()
        run_id = records[-1].run_id
        spec = self._run_tokenizers.get(run_id)
        try:
            if spec is None:
                spec = self._run_tokenizers[run_id] = records[-1].recipe().model.tokenizer
            return await self.tokenizers.aget(spec)
        except (RecipeError, ValueError) as exc:
            raise FailedPrecondition(f"model: the tokenizer of run {run_id!r} does not load: {exc}") from exc

    def _sampling(self, body: dict, tokenizer: Tokenizer) -> common_pb2.SamplingParams:
        values = {name: _sampling_value(body, name, self.runs.limits) for name in OPENAI_FIELDS}
        return common_pb2.SamplingParams(**values, stop_token_ids=[tokenizer.eos_token_id])

    def _prompt_ids(self, prompt: Any, tokenizer: Tokenizer) -> list[int]:
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise InvalidArgument("prompt: must be a string or a list of token ids")
        self._check_ids("prompt", ids)
        return ids

    def _check_ids(self, field: str, ids: list[int]) -> None:
        if not ids:
            raise InvalidArgument(f"{field}: must not be empty")
        longest = self.runs.limits.max_model_len
        if len(ids) > longest:
            raise InvalidArgument(f"{field}: {len(ids)} tokens, more than the longest model length {longest}")
        for i, token in enumerate(ids):
            if not 0 <= token <= INT32_MAX:
                raise InvalidArgument(f"{field}[{i}]: token id {token} is outside [0, {INT32_MAX}]")

    async def _generate(
        self, prompt_ids: list[int], sampling: common_pb2.SamplingParams, prompt_field: str
    ) -> inference_pb2.GenerateResponse:
        if self.router is None:
            raise Unavailable("no inference-router configured (LOOPRL_GATEWAY_ROUTER_ADDRESS)")
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt_ids, sampling=sampling, request_id=uuid.uuid4().hex
        )
        try:
            return await self.router.Generate(request, timeout=120)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            # The router names its own fields (sampling.max_tokens, prompt_token_ids[3]): say the OpenAI ones.
            detail = re.sub(r"^sampling\.", "", exc.details() or "")
            raise InvalidArgument(re.sub(r"^prompt_token_ids", prompt_field, detail)) from exc

    def _usage(self, prompt_ids: list[int], reply: inference_pb2.GenerateResponse) -> dict:
        completion = sum(len(c.token_ids) for c in reply.completions)
        return {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion,
        }

    @staticmethod
    def _text(ids: Any, tokenizer: Tokenizer) -> str:
        return tokenizer.decode([t for t in ids if t != tokenizer.eos_token_id])

    async def completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokenizer = await self._tokenizer()
        ids = self._prompt_ids(body.get("prompt"), tokenizer)
        reply = await self._generate(ids, self._sampling(body, tokenizer), "prompt")
        choices = [
            {
                "index": i,
                "text": self._text(c.token_ids, tokenizer),
                "finish_reason": c.finish_reason,
                "logprobs": None,
            }
            for i, c in enumerate(reply.completions)
        ]
        return web.json_response(self._envelope("text_completion", reply, choices, ids))

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("messages: must be a non-empty list")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise InvalidArgument(f"messages[{i}]: needs string 'role' and 'content'")
        tokenizer = await self._tokenizer()
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as exc:  # the model's chat template refused the conversation
            raise InvalidArgument(f"messages: {exc}") from exc
        self._check_ids("messages", ids)
        reply = await self._generate(ids, self._sampling(body, tokenizer), "messages")
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": self._text(c.token_ids, tokenizer)},
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(reply.completions)
        ]
        return web.json_response(self._envelope("chat.completion", reply, choices, ids))

    def _envelope(
        self, kind: str, reply: inference_pb2.GenerateResponse, choices: list, ids: list[int]
    ) -> dict:
        usage = self._usage(ids, reply)
        count_openai_tokens(kind, usage)
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:12]}",
            "object": kind,
            "created": int(time.time()),
            "model": reply.deployment,
            "choices": choices,
            "usage": usage,
            "weight_version": max((c.weight_version for c in reply.completions), default=0),
        }
