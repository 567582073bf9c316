"""An inference engine that is not looprl's: InferenceEngineService over Hugging Face transformers'
`generate`, in one file that uses nothing of looprl but the contract's generated code
(protos/looprl/inference/v1). It serves a model it is sent: the first weight bucket carries the
Hugging Face config.json, from which it builds a `Qwen2ForCausalLM`; every version after is staged
beside the one served, each slice checked against its checksum, and switched on commit.

    python examples/hf_engine/engine.py --port 7100 --tls-dir DIR [--identity hf-engine]

DIR holds ca.crt and <identity>.crt/.key (`looprl certs DIR --identity hf-engine` issues them from the
stack's CA). Callers are authorized as the contract says: the router generates, weight-sync stages
and commits. `looprl up --recipe R --use inference-engine=HOST:PORT` registers it as R's deployment;
`looprl conformance inference-engine --address HOST:PORT --tls-dir DIR` checks it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch
import xxhash
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "protos"))  # the contract's generated code
from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2 as pb
from looprl.inference.v1 import inference_pb2_grpc

SERVICE = "looprl.inference.v1.InferenceEngineService"
# Who may call what (the contract's callers: looprl's table is services/kit/rpc/authz.py).
CALLERS = {
    "Generate": {"inference-router"},
    "Status": {"inference-router", "weight-sync", "operator"},
    "Pause": {"inference-router"},
    "Resume": {"inference-router"},
    "StageWeights": {"weight-sync"},
    "CommitWeights": {"weight-sync"},
    "AbortWeights": {"weight-sync"},
    "RollbackWeights": {"weight-sync"},
    "ProbeSharedMemory": {"weight-sync"},
}
MAX_N = 256
MAX_PROBE_BYTES = 4096
SEGMENT = re.compile(r"^looprl-ws-(\d+)-[A-Za-z0-9_.-]+$")
DTYPES = {
    common_pb2.D_TYPE_FLOAT32: (np.float32, torch.float32),
    common_pb2.D_TYPE_BFLOAT16: (None, torch.bfloat16),
}


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(message: str) -> Refused:
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, message)


def sum64(data: bytes) -> int:
    """nbytes plus the sum of the little-endian 8-byte words mod 2^64, the last word zero-padded."""
    padded = data + b"\0" * (-len(data) % 8)
    words = np.frombuffer(padded, dtype="<u8")
    return (len(data) + int(words.sum(dtype=np.uint64))) % (1 << 64)


# ---- weights ----------------------------------------------------------------------------------------


@dataclass
class Staged:
    """A version being received: every parameter's flat buffer and how many elements arrived."""

    version: int
    buffers: dict[str, torch.Tensor]
    filled: dict[str, int] = field(default_factory=dict)
    buckets: set[int] = field(default_factory=set)
    bucket_count: int = 0
    failed: str = ""

    @property
    def complete(self) -> bool:
        return (
            not self.failed
            and self.bucket_count > 0
            and len(self.buckets) == self.bucket_count
            and all(self.filled.get(n, 0) == b.numel() for n, b in self.buffers.items())
        )


class HFEngine(inference_pb2_grpc.InferenceEngineServiceServicer):
    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.model = None
        self.config: dict | None = None
        self.version = -1
        self.staged: Staged | None = None
        self.previous: tuple[int, dict[str, torch.Tensor]] | None = None  # the rollback point
        self.lock = threading.Lock()  # generation and weight switches never interleave
        self.resumed = threading.Event()
        self.resumed.set()
        self.queued = 0

    # -- the model ------------------------------------------------------------------------------------

    def _build(self, config_json: str) -> None:
        from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

        try:
            config = json.loads(config_json)
            hf_config = Qwen2Config(**{k: v for k, v in config.items() if k != "architectures"})
        except (ValueError, TypeError) as exc:
            raise invalid(f"model_config_json: not a Qwen2 config.json: {exc}") from None
        if self.model is not None:
            if config != self.config:
                raise invalid("model_config_json: differs from the model this engine serves")
            return
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(hf_config).eval()
        model.generation_config = GenerationConfig()
        self.model, self.config = model, config

    def _params(self) -> dict[str, torch.Tensor]:
        """What a version sends: every parameter, but a tied lm_head (it is the embedding)."""
        state = self.model.state_dict()
        if self.model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state

    # -- StageWeights -----------------------------------------------------------------------------------

    def StageWeights(self, request_iterator, context):
        received = 0
        last = None
        for msg in request_iterator:
            last = msg
            received += self._stage_bucket(msg)
            if msg.commit_when_complete and self.staged is not None and self.staged.complete:
                self._commit(msg.version)
        if last is None:
            raise invalid("StageWeights: the stream carried no bucket")
        staged = self.staged
        complete = staged is not None and staged.version == last.version and staged.complete
        return pb.StageWeightsResponse(
            version=last.version,
            bytes_received=received,
            complete=complete or self.version == last.version,
            serving_version=self.version,
        )

    def _stage_bucket(self, msg: pb.StageWeightsRequest) -> int:
        if msg.rank != 0:
            raise invalid(f"rank: this engine holds one rank (0), got {msg.rank}")
        if self.model is None:
            if not msg.model_config_json:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "model_config_json: this engine has no model yet; the first bucket must carry config.json",
                )
            self._build(msg.model_config_json)
        elif msg.model_config_json:
            self._build(msg.model_config_json)
        staged = self.staged
        if staged is None or staged.version != msg.version:
            newest = max(self.version, staged.version if staged is not None else -1)
            if msg.version <= newest:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"version: {msg.version} is not newer than the version served or staged ({newest})",
                )
            params = self._params()
            staged = Staged(
                msg.version, {n: torch.empty(t.numel(), dtype=t.dtype) for n, t in params.items()}
            )
            self.staged = staged
        if staged.failed:
            raise Refused(
                grpc.StatusCode.DATA_LOSS, f"version: {msg.version} failed its checks: {staged.failed}"
            )
        if msg.device_handle or msg.nccl_broadcast:
            raise invalid("device_handle: this engine receives weights inline (gRPC) only")
        if msg.bucket_count < 1 or not 0 <= msg.bucket_index < msg.bucket_count:
            raise invalid(f"bucket_index: {msg.bucket_index} outside [0, bucket_count={msg.bucket_count})")
        staged.bucket_count = msg.bucket_count
        received = 0
        for i, piece in enumerate(msg.slices):
            received += self._stage_slice(staged, piece, f"slices[{i}]")
        staged.buckets.add(msg.bucket_index)
        return received

    def _stage_slice(self, staged: Staged, piece: pb.WeightSlice, where: str) -> int:
        buffer = staged.buffers.get(piece.name)
        if buffer is None:
            raise invalid(f"{where}.name: {piece.name!r} is not a parameter of this model")
        if piece.dtype not in DTYPES or DTYPES[piece.dtype][1] != buffer.dtype:
            raise invalid(
                f"{where}.dtype: {piece.name} is {buffer.dtype}, got {common_pb2.DType.Name(piece.dtype)}"
            )
        expected_shape = list(self.model.state_dict()[piece.name].shape)
        if list(piece.shape) != expected_shape:
            raise invalid(f"{where}.shape: {piece.name} is {expected_shape}, got {list(piece.shape)}")
        if piece.shm_name:
            raise invalid(f"{where}.shm_name: this engine receives weights inline (gRPC) only")
        data = piece.data
        itemsize = buffer.element_size()
        count = len(data) // itemsize
        if len(data) % itemsize or piece.offset < 0 or piece.offset + count > buffer.numel():
            raise invalid(f"{where}.offset: {count} elements at {piece.offset} do not fit {piece.name}")
        if piece.HasField("sum64"):
            ok = sum64(data) == piece.sum64
        elif piece.HasField("hash64"):
            ok = xxhash.xxh3_64_intdigest(data) == piece.hash64
        else:
            raise invalid(f"{where}: {piece.name} carries neither hash64 nor sum64")
        if not ok:
            staged.failed = f"{piece.name} at {piece.offset}: bytes do not match their checksum"
            raise Refused(grpc.StatusCode.DATA_LOSS, f"{where}: {staged.failed}")
        values = torch.frombuffer(bytearray(data), dtype=buffer.dtype) if count else buffer[:0]
        buffer[piece.offset : piece.offset + count] = values
        staged.filled[piece.name] = staged.filled.get(piece.name, 0) + count
        return len(data)

    # -- commit, abort, rollback ------------------------------------------------------------------------

    def _commit(self, version: int) -> int:
        if version == self.version:
            return version  # a retried commit
        staged = self.staged
        if staged is None or staged.version != version or not staged.complete:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"version: {version} is not completely staged and verified (serving {self.version})",
            )
        with self.lock:
            current = {n: t.detach().clone() for n, t in self._params().items()}
            self._load(staged.buffers)
            self.previous = (self.version, current) if self.version >= 0 else None
            self.version = version
            self.staged = None
        return version

    def _load(self, flat: dict[str, torch.Tensor]) -> None:
        params = self._params()
        with torch.no_grad():
            for name, tensor in params.items():
                tensor.copy_(flat[name].view(tensor.shape))

    def CommitWeights(self, request, context):
        return pb.CommitWeightsResponse(weight_version=self._commit(request.version))

    def AbortWeights(self, request, context):
        if self.staged is not None and self.staged.version == request.version:
            self.staged = None
        return pb.AbortWeightsResponse()

    def RollbackWeights(self, request, context):
        if request.version != self.version:
            if request.version > self.version:
                return pb.RollbackWeightsResponse(weight_version=self.version)  # a retried rollback
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"version: {request.version} is not served")
        if self.previous is None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION, f"version: nothing served before {self.version}"
            )
        with self.lock:
            before, weights = self.previous
            self._load({n: t.reshape(-1) for n, t in weights.items()})
            self.version, self.previous = before, None
        return pb.RollbackWeightsResponse(weight_version=self.version)

    # -- generation -------------------------------------------------------------------------------------

    def _validate(self, req: pb.GenerateRequest) -> None:
        s, vocab = req.sampling, self.model.config.vocab_size
        if not req.prompt_token_ids:
            raise invalid("prompt_token_ids: must not be empty")
        bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        if not math.isfinite(s.temperature) or s.temperature < 0:
            raise invalid(f"sampling.temperature: must be >= 0, got {s.temperature}")
        if not math.isfinite(s.top_p) or not 0 <= s.top_p <= 1:
            raise invalid(f"sampling.top_p: must be in (0, 1], got {s.top_p}")
        if s.top_k < 0:
            raise invalid(f"sampling.top_k: must be >= 0 (0 disables), got {s.top_k}")
        if s.max_tokens <= 0:
            raise invalid(f"sampling.max_tokens: must be > 0, got {s.max_tokens}")
        if len(req.prompt_token_ids) + s.max_tokens > self.max_model_len:
            raise invalid(
                f"sampling.max_tokens: prompt ({len(req.prompt_token_ids)}) + max_tokens ({s.max_tokens}) "
                f"exceeds the model length {self.max_model_len}"
            )
        bad = next((t for t in s.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"sampling.stop_token_ids: token id {bad} is outside the vocabulary")
        if s.n < 0 or s.n > MAX_N:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"sampling.n: {s.n} completions, at most {MAX_N}"
            )

    def Generate(self, request, context):
        if self.model is None or self.version < 0:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "this engine holds no weights yet")
        self._validate(request)
        self.queued += 1
        try:
            # Paused: wait (the caller's deadline still ends the call).
            while not self.resumed.wait(0.05):
                if not context.is_active():
                    raise Refused(
                        grpc.StatusCode.CANCELLED, "the caller went away while the engine was paused"
                    )
            with self.lock:
                return self._generate(request)
        finally:
            self.queued -= 1

    def _generate(self, req: pb.GenerateRequest) -> pb.GenerateResponse:
        from transformers import GenerationConfig

        s = req.sampling
        n = s.n or 1
        stops = list(s.stop_token_ids)
        greedy = s.temperature == 0
        config = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else s.temperature,
            top_k=s.top_k,
            top_p=s.top_p or 1.0,
            max_new_tokens=s.max_tokens,
            eos_token_id=stops or None,
            pad_token_id=stops[0] if stops else 0,
            num_return_sequences=n,
            output_logits=True,
            return_dict_in_generate=True,
        )
        if s.seed:
            torch.manual_seed(s.seed & 0xFFFF_FFFF_FFFF_FFFF)
        prompt = torch.tensor([list(req.prompt_token_ids)], dtype=torch.long)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=config
            )
        new = out.sequences[:, prompt.shape[1] :]
        # Log-prob of each sampled token under logits / temperature, before top-k/top-p truncation.
        logits = torch.stack(out.logits, dim=1).float()  # [n, steps, vocab]
        scaled = logits if greedy else logits / s.temperature
        logprobs = torch.log_softmax(scaled, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        completions = []
        for i in range(n):
            tokens = new[i].tolist()
            end = next((j + 1 for j, t in enumerate(tokens) if t in stops), len(tokens))
            finish = "stop" if end <= len(tokens) and tokens[end - 1] in stops else "length"
            completions.append(
                pb.Completion(
                    token_ids=tokens[:end],
                    logprobs=logprobs[i, :end].tolist(),
                    finish_reason=finish,
                    weight_version=self.version,
                )
            )
        return pb.GenerateResponse(completions=completions, prompt_tokens=len(req.prompt_token_ids))

    # -- the rest -----------------------------------------------------------------------------------------

    def Status(self, request, context):
        return pb.StatusResponse(
            weight_version=self.version,
            queued_requests=self.queued,
            paused=not self.resumed.is_set(),
            staged_version=self.staged.version if self.staged is not None else -1,
            rollback_version=self.previous[0] if self.previous is not None else -1,
            holds_for_version=False,  # the router waits for a version before it sends a request
        )

    def Pause(self, request, context):
        self.resumed.clear()
        return pb.PauseResponse()

    def Resume(self, request, context):
        self.resumed.set()
        return pb.ResumeResponse()

    def ProbeSharedMemory(self, request, context):
        if not SEGMENT.match(request.segment):
            raise invalid(f"segment: {request.segment!r} is not a weight-sync segment name")
        if not 0 < request.nbytes <= MAX_PROBE_BYTES:
            raise invalid(f"nbytes: must be in 1..{MAX_PROBE_BYTES}, got {request.nbytes}")
        try:
            with open(Path("/dev/shm") / request.segment, "rb") as f:
                data = f.read(request.nbytes)
        except FileNotFoundError:
            raise Refused(
                grpc.StatusCode.NOT_FOUND, f"segment: {request.segment!r} does not exist here"
            ) from None
        return pb.ProbeSharedMemoryResponse(data=data)


# ---- serving ----------------------------------------------------------------------------------------


class Doors(grpc.ServerInterceptor):
    """Authorization by the caller's certificate, malformed requests as INVALID_ARGUMENT, and a
    refusal as its status code (anything else is INTERNAL)."""

    def __init__(self, secure: bool) -> None:
        self.secure = secure

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        method = details.method.rsplit("/", 1)[-1]
        if handler is None or not details.method.startswith(f"/{SERVICE}/"):
            return handler  # health and reflection: any certificate of the CA
        secure = self.secure

        def guard(behavior, streaming_request: bool):
            def run(request, context):
                if secure:
                    names = (context.auth_context() or {}).get("x509_common_name") or []
                    caller = names[0].decode() if names else None
                    if caller not in CALLERS[method]:
                        who = ", ".join(sorted(CALLERS[method]))
                        context.abort(
                            grpc.StatusCode.PERMISSION_DENIED,
                            f"{method}: {caller!r} may not call it (allowed: {who})",
                        )
                try:
                    return behavior(_parsed(request, handler, streaming_request), context)
                except Refused as exc:
                    context.abort(exc.code, str(exc))
                except _Malformed as exc:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: malformed request ({exc})")

            return run

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                guard(handler.unary_unary, False), response_serializer=handler.response_serializer
            )
        return grpc.stream_unary_rpc_method_handler(
            guard(handler.stream_unary, True), response_serializer=handler.response_serializer
        )


class _Malformed(Exception):
    pass


def _parsed(request, handler, streaming: bool):
    """Requests arrive as bytes (the handlers are registered without deserializers) and are parsed
    here, so bytes that do not parse are INVALID_ARGUMENT rather than gRPC's INTERNAL."""

    def parse(raw: bytes):
        try:
            return handler.request_deserializer(raw)
        except Exception as exc:
            raise _Malformed(str(exc)) from None

    if streaming:
        return (parse(raw) for raw in request)
    return parse(request)


def serve(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    engine = HFEngine(args.max_model_len)
    secure = not args.insecure
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        interceptors=[Doors(secure)],
        options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)],
    )
    inference_pb2_grpc.add_InferenceEngineServiceServicer_to_server(engine, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{args.host}:{args.port}"
    if secure:
        if not args.tls_dir:
            sys.exit("hf-engine: give --tls-dir DIR (ca.crt, <identity>.crt/.key) or --insecure")
        d = Path(args.tls_dir)
        creds = grpc.ssl_server_credentials(
            [((d / f"{args.identity}.key").read_bytes(), (d / f"{args.identity}.crt").read_bytes())],
            root_certificates=(d / "ca.crt").read_bytes(),
            require_client_auth=True,
        )
        port = server.add_secure_port(address, creds)
    else:
        print("hf-engine: TLS is OFF (--insecure): no caller is authenticated", file=sys.stderr)
        port = server.add_insecure_port(address)
    server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"ADDRESS {args.host}:{port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.stop(grace=2).wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tls-dir", default=os.environ.get("LOOPRL_TLS_DIR", ""))
    parser.add_argument("--identity", default="hf-engine", help="its certificate in --tls-dir")
    parser.add_argument("--insecure", action="store_true", help="plaintext, no authorization")
    parser.add_argument("--max-model-len", type=int, default=128, help="longest prompt + completion served")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    serve(parser.parse_args())


if __name__ == "__main__":
    main()
