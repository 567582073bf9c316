"""Length-profile routing by the predicted output length a request carries, and the prediction
error the router measures from what each completion really was (fake replicas, real router)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from services.inference_router.policies import DeploymentState, LengthProfile, ReplicaState
from services.inference_router.replica_status import ReplicaStatus
from services.inference_router.router import Router


class LengthReplica:
    """Answers every request with `length` tokens."""

    def __init__(self, name: str, length: int) -> None:
        self.name, self.length = name, length

    async def generate(self, request, timeout_s):
        comp = inference_pb2.Completion(token_ids=[5] * self.length, finish_reason="stop", weight_version=1)
        return inference_pb2.GenerateResponse(completions=[comp] * (request.sampling.n or 1))

    async def generate_stream(self, request, timeout_s):
        yield inference_pb2.GenerateStreamResponse(index=0, token_ids=[5] * self.length, weight_version=1)
        yield inference_pb2.GenerateStreamResponse(index=0, finish_reason="stop")

    async def status(self, timeout_s):
        return ReplicaStatus(replica=self.name, weight_version=1, ready=True, address=f"fake:{self.name}")

    async def close(self):
        pass


def _router(length: int) -> Router:
    router = Router()
    for name, profile in (
        ("lr-short", LengthProfile(max_output_tokens=16)),
        ("lr-long", LengthProfile(min_output_tokens=17)),
    ):
        dep = DeploymentState(name=name, profile=profile, max_model_len=512)
        fake = LengthReplica(f"{name}-0", length)
        dep.replicas = [ReplicaState(name=fake.name, deployment=name)]
        router.add_deployment(dep, [fake])
    return router


def _request(expected: int, n: int = 1) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3],
        sampling=common_pb2.SamplingParams(max_tokens=200, n=n),
        expected_output_tokens=expected,
    )


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_requests_go_where_their_predicted_length_fits_and_max_tokens_decides_without_one():
    router = _router(length=10)
    await router.poll_once()
    predicted_short = await router.generate(_request(expected=8))
    predicted_long = await router.generate(_request(expected=150))
    unpredicted = await router.generate(_request(expected=0))  # read as max_tokens = 200
    assert predicted_short.deployment == "lr-short"
    assert predicted_long.deployment == unpredicted.deployment == "lr-long"


async def test_the_prediction_error_and_profile_fit_of_every_completion_are_metrics():
    router = _router(length=10)
    await router.poll_once()
    before = {
        key: _sample("looprl_router_length_predictions_total", deployment=dep, outcome=outcome)
        for key, (dep, outcome) in {
            "fit": ("lr-short", "in_profile"),
            "miss": ("lr-long", "outside_profile"),
            "none": ("lr-long", "unpredicted"),
        }.items()
    }
    error_sum = _sample("looprl_router_length_prediction_error_tokens_sum", deployment="lr-short")
    await router.generate(_request(expected=12, n=3))  # 3 completions of 10 tokens on lr-short
    await router.generate(_request(expected=100))  # routed long, but came back 10 tokens long
    await router.generate(_request(expected=0))
    async for _ in router.generate_stream(_request(expected=7)):  # streamed: same accounting
        pass
    after = lambda dep, outcome: _sample(  # noqa: E731
        "looprl_router_length_predictions_total", deployment=dep, outcome=outcome
    )
    assert after("lr-short", "in_profile") - before["fit"] == 4
    assert after("lr-long", "outside_profile") - before["miss"] == 1
    assert after("lr-long", "unpredicted") - before["none"] == 1
    new_error = _sample("looprl_router_length_prediction_error_tokens_sum", deployment="lr-short") - error_sum
    assert new_error == 3 * 2 + 3
