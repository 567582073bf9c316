"""HTTP/JSON API: the run routes, and the OpenAI-compatible routes of gateway/openai_api.py.

Every route but /healthz needs a bearer token; its tenant (gateway/config.py) sees only its own runs
(another tenant's run is a 404, as if it did not exist) unless it is an admin. Errors use OpenAI's {"error": {"message", "type",
"param", "code"}} shape with the HTTP status that matches the gRPC one; `param` names the offending
field.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import grpc
from aiohttp import web
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from gateway.auth import TokenAuth
from gateway.metrics import http_metrics, init_routes
from gateway.openai_api import TENANT, OpenAIEndpoints, OpenAIError, json_body
from gateway.servicer import RunManager
from looprl.gateway.v1 import gateway_pb2
from looprl.inference.v1 import inference_pb2_grpc
from services.kit.rpc.errors import InvalidArgument, ServiceError
from services.modeling.tokenizer import TokenizerCache

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
    except OpenAIError as exc:
        return _error(exc.status, exc.message, exc.code, exc.param)
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


_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def _run_json(run) -> dict:
    """The run as JSON: every field, zeros included, and every integer a JSON number (proto3's JSON
    mapping omits zeros and writes 64-bit integers as strings, which no client of a run API expects)."""
    out = MessageToDict(run, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _integers_as_numbers(run.DESCRIPTOR, out)
    return out


def _integers_as_numbers(descriptor, value: dict) -> None:
    for f in descriptor.fields:
        if f.name not in value:
            continue
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            entry = f.message_type.fields_by_name["value"]
            if entry.type in _INT64:
                value[f.name] = {k: int(v) for k, v in value[f.name].items()}
            elif entry.message_type is not None:
                for v in value[f.name].values():
                    _integers_as_numbers(entry.message_type, v)
        elif f.message_type is not None:
            for v in value[f.name] if f.is_repeated else [value[f.name]]:
                _integers_as_numbers(f.message_type, v)
        elif f.type in _INT64:
            value[f.name] = [int(v) for v in value[f.name]] if f.is_repeated else int(value[f.name])


_JSON_KINDS = {
    FieldDescriptor.TYPE_STRING: (str, "a string"),
    FieldDescriptor.TYPE_BOOL: (bool, "a boolean"),
}


def request_message(body: dict, message_type: type[Message]) -> Message:
    """The JSON body as a `message_type` request: every key a field of it and every value of its
    field's type (null: the field's default), else INVALID_ARGUMENT naming the field. Nothing is
    dropped or coerced on the way, as a lenient JSON-to-protobuf parse would."""
    fields = message_type.DESCRIPTOR.fields_by_name
    message = message_type()
    for key, value in body.items():
        field = fields.get(key)
        if field is None:
            raise InvalidArgument(f"{key}: unknown field (the body's fields are {', '.join(fields)})")
        if value is None:
            continue
        kind, words = _JSON_KINDS[field.type]  # a request field of another type needs a row here
        if field.is_repeated or not isinstance(value, kind):
            raise InvalidArgument(f"{key}: must be {words}, got {json.dumps(value)[:80]}")
        setattr(message, key, value)
    return message


class HttpApi:
    def __init__(
        self,
        runs: RunManager,
        auth: TokenAuth,
        router: inference_pb2_grpc.InferenceRouterServiceStub | None,
        tokenizers: TokenizerCache,
    ) -> None:
        self.runs, self.auth = runs, auth
        self.openai = OpenAIEndpoints(runs, router, tokenizers)

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
                web.get("/v1/runs/{run_id}/watch", self.watch_run),
                *self.openai.routes(),
            ]
        )
        init_routes(app)
        return app

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/healthz":
            request[TENANT] = self.auth.check(request.headers.get("Authorization"))
        return await handler(request)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def create_run(self, request: web.Request) -> web.Response:
        create = request_message(await json_body(request), gateway_pb2.CreateRunRequest)
        if not create.recipe_toml:
            raise InvalidArgument("recipe_toml: required string (the recipe's TOML text)")
        record = await self.runs.create(create.recipe_toml, create.run_id, request[TENANT])
        return web.json_response(_run_json(await self.runs.proto(record)), status=201)

    async def list_runs(self, request: web.Request) -> web.Response:
        queue = await self.runs.queue()
        runs = [_run_json(await self.runs.proto(r, queue)) for r in await self.runs.list(request[TENANT])]
        return web.json_response({"runs": runs})

    async def get_run(self, request: web.Request) -> web.Response:
        record = await self.runs.get(request.match_info["run_id"], request[TENANT])
        return web.json_response(_run_json(await self.runs.proto(record)))

    async def watch_run(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: one `data: <run>` event now and on every change, until the run ends."""
        runs = self.runs.watch(request.match_info["run_id"], request[TENANT])
        first = await anext(runs)  # NotFound / InvalidArgument still answer as plain errors
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        await response.write(f"data: {json.dumps(_run_json(first))}\n\n".encode())
        async for run in runs:
            await response.write(f"data: {json.dumps(_run_json(run))}\n\n".encode())
        await response.write_eof()
        return response

    async def stop_run(self, request: web.Request) -> web.Response:
        record = await self.runs.stop(request.match_info["run_id"], request[TENANT])
        return web.json_response(_run_json(await self.runs.proto(record)))
