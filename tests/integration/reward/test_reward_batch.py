"""Batched scoring against a real reward service process: ScoreBatch answers in order and names a
bad request by index; the environment-sandbox's RewardClient sends the scores of a group that
finish together as one ScoreBatch call and still gives each episode its own answer or error."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import grpc
import pytest

from looprl.reward.v1 import reward_pb2, reward_pb2_grpc
from services.environment_sandbox.clients import RewardClient
from tests.support.service_process import service_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reward_service():
    with service_process("services.reward", {}) as svc:
        yield svc.address, svc.metrics_url


def _calls(metrics_url: str, method: str) -> int:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    pattern = rf'looprl_rpc_requests_total{{[^}}]*method="[^"]*/{method}"[^}}]*}} ([0-9.e+]+)'
    return int(sum(float(v) for v in re.findall(pattern, text)))


def _exact(answer: str, completion: str) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(
        reward="exact", task_json=json.dumps({"answer": answer}), completion=completion
    )


def test_score_batch_answers_in_order_and_names_a_bad_request(reward_service):
    stub = reward_pb2_grpc.RewardServiceStub(grpc.insecure_channel(reward_service[0]))
    requests = [_exact("a", "a"), _exact("a", "b"), _exact("xy", "xy")]
    scores = [r.score for r in stub.ScoreBatch(reward_pb2.ScoreBatchRequest(requests=requests)).responses]
    assert scores == [1.0, 0.0, 1.0]

    bad_json = [*requests[:2], reward_pb2.ScoreRequest(reward="exact", task_json="[1")]
    with pytest.raises(grpc.RpcError) as err:
        stub.ScoreBatch(reward_pb2.ScoreBatchRequest(requests=bad_json))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "requests[2].task_json" in err.value.details()

    unknown = [requests[0], reward_pb2.ScoreRequest(reward="nope", task_json="{}")]
    with pytest.raises(grpc.RpcError) as err:
        stub.ScoreBatch(reward_pb2.ScoreBatchRequest(requests=unknown))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "requests[1]" in err.value.details()
    # Still serving after the refusals.
    assert stub.Score(_exact("a", "a")).score == 1.0


async def test_client_sends_a_group_as_one_batch_and_isolates_a_bad_request(reward_service):
    address, metrics = reward_service
    async with grpc.aio.insecure_channel(address) as channel:
        client = RewardClient(channel)
        before = _calls(metrics, "ScoreBatch")
        completions = ["12", "21", "12", "x", "12", "21", "12", "12"]
        scores = await asyncio.gather(
            *(
                client("exact", json.dumps({"answer": "12"}), c, f"r{i}", "", None)
                for i, c in enumerate(completions)
            )
        )
        assert [s.score for s in scores] == [1.0 if c == "12" else 0.0 for c in completions]
        assert _calls(metrics, "ScoreBatch") == before + 1  # eight scores, one round trip

        # One bad request among good ones: the batch is refused, then each is retried alone, so the
        # good ones are scored and only the bad one's episode sees the error.
        results = await asyncio.gather(
            client("exact", json.dumps({"answer": "1"}), "1", "g1", "", None),
            client("exact", "[not json", "1", "bad", "", None),
            client("exact", json.dumps({"answer": "2"}), "1", "g2", "", None),
            return_exceptions=True,
        )
        assert results[0].score == 1.0 and results[2].score == 0.0
        assert isinstance(results[1], grpc.aio.AioRpcError)
        assert results[1].code() == grpc.StatusCode.INVALID_ARGUMENT and "task_json" in results[1].details()
