"""A run's tokenizer end to end: a real gateway admits a recipe whose model is the Hugging Face-format
checkpoint tools/build_hf_model.py builds, a real environment-sandbox process (default tokenizer:
char) plays its multi-turn episodes from the EPISODES work queue, and every GenerateRequest that
reaches the router is exactly `transformers.AutoTokenizer.apply_chat_template(messages,
add_generation_prompt=True)` of the conversation so far; the gateway's OpenAI chat endpoint renders
and decodes with the same run's tokenizer.

The router here records the requests it receives and answers each with the tokens of "0" (so every
guess is too low and the episode runs its three turns): a model behind it would only make what it
answers random, while what is checked is what it is sent."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import transformers

from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.kit.local.infra import NatsServer, free_port
from services.modeling.tokenizer import load_tokenizer
from tests.support.gateway import GatewayProcess, http
from tests.support.service_process import service_process
from tools.build_hf_model import build

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPLY = "0"


class RecordingRouter(inference_pb2_grpc.InferenceRouterServiceServicer):
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: list[inference_pb2.GenerateRequest] = []
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.requests.append(request)
        ids = [*self.tokenizer.encode(REPLY), self.tokenizer.eos_token_id]
        completion = inference_pb2.Completion(
            token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", weight_version=0
        )
        return inference_pb2.GenerateResponse(
            completions=[completion] * max(1, request.sampling.n), deployment="recorder"
        )

    def ListDeployments(self, request, context):
        """The recipe's default deployment, with one replica (what the gateway admits a run against)."""
        from services.kit.config.recipe import DeploymentSpec

        info = inference_pb2.DeploymentInfo(
            name=DeploymentSpec().name, replicas=[inference_pb2.ReplicaInfo()]
        )
        return inference_pb2.ListDeploymentsResponse(deployments=[info])

    def of_run(self, run_id: str) -> list[inference_pb2.GenerateRequest]:
        with self.lock:
            return [r for r in self.requests if r.session_id.startswith(f"{run_id}/")]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "tiny-bpe"
    build(out, seed=0)
    return out


def _template_ids(hf, messages: list[dict]) -> list[int]:
    return list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def test_the_environment_and_the_openai_endpoint_use_the_runs_tokenizer(hf_dir, tmp_path):
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    recorder = RecordingRouter(load_tokenizer(hf_dir))
    router = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    inference_pb2_grpc.add_InferenceRouterServiceServicer_to_server(recorder, router)
    router_address = f"127.0.0.1:{router.add_insecure_port('127.0.0.1:0')}"
    router.start()
    nats = NatsServer(state_dir=tmp_path / "nats", port=free_port()).start()
    gateway = None
    try:
        gateway = GatewayProcess(nats.url, tmp_path, router_address=router_address).start()
        env = {
            "LOOPRL_NATS_URL": nats.url,
            "LOOPRL_ENV_ROUTER_ADDRESS": router_address,
            "LOOPRL_ENV_SANDBOX__WARM_WORKERS": "0",
            "LOOPRL_STATE_DIR": str(tmp_path),
        }
        with service_process("services.environment_sandbox", env, 60):
            recipe = f"""
[run]
name = "hf-tokenizer"
steps = 1
[model]
path = "{hf_dir}"
tokenizer = "{hf_dir}"
[environment]
name = "guess"
max_turns = 3
[sampling]
max_tokens = 4
[batch]
rollouts_per_step = 2
group_size = 2
"""
            status, run = http(gateway, "/v1/runs", {"recipe_toml": recipe, "run_id": "hf-tok"})
            assert status == 201, run
            # One forked group: the prompt once for both branches (n=2), then each branch's two
            # later turns.
            deadline = time.monotonic() + 90
            while len(recorder.of_run("hf-tok")) < 5:
                assert time.monotonic() < deadline, f"{len(recorder.of_run('hf-tok'))} requests arrived"
                time.sleep(0.2)
        requests = recorder.of_run("hf-tok")
        conversation = [
            {"role": "user", "content": "guess 1-16"},  # the guess environment's default range
            {"role": "assistant", "content": REPLY},
            {"role": "user", "content": "higher"},
            {"role": "assistant", "content": REPLY},
            {"role": "user", "content": "higher"},
        ]
        expected = [_template_ids(hf, conversation[:end]) for end in (1, 3, 5)]
        sent = sorted((list(r.prompt_token_ids), r.sampling.n) for r in requests)
        assert sent == sorted(
            [(expected[0], 2), (expected[1], 1), (expected[1], 1), (expected[2], 1), (expected[2], 1)]
        )

        # The OpenAI endpoint serves the run's model: its chat template in, its tokenizer out.
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
        status, chat = http(gateway, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
        assert status == 200, chat
        (served,) = [r for r in recorder.requests if not r.session_id]
        assert list(served.prompt_token_ids) == _template_ids(hf, messages)
        assert list(served.sampling.stop_token_ids) == [hf.eos_token_id]
        assert chat["choices"][0]["message"]["content"] == REPLY
        status, completion = http(
            gateway, "/v1/completions", {"prompt": "Ann has 12 apples", "max_tokens": 4}
        )
        assert status == 200 and completion["choices"][0]["text"] == REPLY, completion
        assert list(recorder.requests[-1].prompt_token_ids) == hf.encode(
            "Ann has 12 apples", add_special_tokens=False
        )
    finally:
        if gateway is not None:
            gateway.kill()
        nats.stop()
        router.stop(0)
