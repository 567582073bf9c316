"""HTTP/JSON API: runs, and an OpenAI-compatible /v1/completions and /v1/chat/completions.

The OpenAI-compatible endpoints tokenize, forward to the inference-router's Generate and
decode, so agent frameworks and evaluators can use the policy being trained. Every route but
/healthz needs a bearer token. Errors use OpenAI's {"error": {...}} shape with the HTTP status
that matches the gRPC one.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import grpc
from aiohttp import web
from google.protobuf.json_format import MessageToDict

from gateway.auth import TokenAuth
from gateway.service import RunManager, run_to_proto
from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.kit.errors import InvalidArgument, ServiceError, Unavailable

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


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": code.lower(), "code": code}}, status=status
    )


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ServiceError as exc:
        return _error(HTTP_STATUS.get(exc.code, 500), exc.message, exc.code.name)
    except grpc.aio.AioRpcError as exc:
        return _error(HTTP_STATUS.get(exc.code(), 502), exc.details() or "", exc.code().name)


def _run_json(run) -> dict:
    return MessageToDict(run, preserving_proto_field_name=True)


class HttpApi:
    def __init__(
        self,
        runs: RunManager,
        auth: TokenAuth,
        router: inference_pb2_grpc.InferenceRouterServiceStub | None,
        tokenizer: Any,
    ) -> None:
        self.runs, self.auth, self.router, self.tokenizer = runs, auth, router, tokenizer

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors, self._authenticate])
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

    def _sampling(self, body: dict) -> common_pb2.SamplingParams:
        def number(name: str, default: float, kind: type = float) -> Any:
            value = body.get(name, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgument(f"{name}: must be a number, got {value!r}")
            return kind(value)

        return common_pb2.SamplingParams(
            temperature=number("temperature", 1.0),
            top_p=number("top_p", 1.0),
            max_tokens=number("max_tokens", 16, int),
            n=number("n", 1, int),
            seed=number("seed", 0, int),
            stop_token_ids=[self.tokenizer.eos_token_id],
        )

    async def _generate(self, prompt_ids: list[int], body: dict) -> inference_pb2.GenerateResponse:
        if self.router is None:
            raise Unavailable("no inference-router configured (LOOPRL_GATEWAY_ROUTER_ADDRESS)")
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt_ids, sampling=self._sampling(body), request_id=uuid.uuid4().hex
        )
        return await self.router.Generate(request, timeout=120)

    def _usage(self, prompt_ids: list[int], reply: inference_pb2.GenerateResponse) -> dict:
        completion = sum(len(c.token_ids) for c in reply.completions)
        return {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion,
        }

    def _text(self, ids: Any) -> str:
        return self.tokenizer.decode([t for t in ids if t != self.tokenizer.eos_token_id])

    async def completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            raise InvalidArgument("prompt: must be a string or a list of token ids")
        reply = await self._generate(ids, body)
        choices = [
            {"index": i, "text": self._text(c.token_ids), "finish_reason": c.finish_reason, "logprobs": None}
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
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        reply = await self._generate(ids, body)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": self._text(c.token_ids)},
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(reply.completions)
        ]
        return web.json_response(self._envelope("chat.completion", reply, choices, ids))

    def _envelope(
        self, kind: str, reply: inference_pb2.GenerateResponse, choices: list, ids: list[int]
    ) -> dict:
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:12]}",
            "object": kind,
            "created": int(time.time()),
            "model": reply.deployment,
            "choices": choices,
            "usage": self._usage(ids, reply),
            "weight_version": max((c.weight_version for c in reply.completions), default=0),
        }
