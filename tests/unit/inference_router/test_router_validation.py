"""Request validation and router config parsing: bad input names the field."""

from __future__ import annotations

import json

import pytest

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from services.inference_router.config import RouterConfig
from services.inference_router.policies import DeploymentState
from services.inference_router.router import Router
from services.inference_router.servicer import validate_request
from services.kit.config.service import ConfigError, load_config
from services.kit.rpc.errors import InvalidArgument


def _router() -> Router:
    router = Router()
    router.deployments["short"] = DeploymentState(name="short", vocab_size=100, max_model_len=64)
    return router


def _req(**kw):
    sampling = kw.pop("sampling", {})
    return inference_pb2.GenerateRequest(
        prompt_token_ids=kw.pop("prompt", [1, 2]),
        sampling=common_pb2.SamplingParams(**{"max_tokens": 4, **sampling}),
        **kw,
    )


@pytest.mark.parametrize(
    "request_kw,field",
    [
        ({"prompt": []}, "prompt_token_ids"),
        ({"prompt": [1, 100]}, "prompt_token_ids[1]"),
        ({"prompt": [-3]}, "prompt_token_ids[0]"),
        ({"sampling": {"temperature": -0.5}}, "sampling.temperature"),
        ({"sampling": {"temperature": float("nan")}}, "sampling.temperature"),
        ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
        ({"sampling": {"top_p": 1.5}}, "sampling.top_p"),
        ({"sampling": {"top_k": -1}}, "sampling.top_k"),
        ({"sampling": {"stop_token_ids": [5, 1000]}}, "sampling.stop_token_ids[1]"),
        ({"deployment": "nope"}, "deployment"),
        ({"min_weight_version": -1}, "min_weight_version"),
    ],
)
def test_bad_requests_name_the_field(request_kw, field):
    with pytest.raises(InvalidArgument) as err:
        validate_request(_req(**request_kw), _router())
    assert err.value.message.startswith(field + ":"), err.value.message


def test_good_request_passes_and_stream_paths_are_prefixed():
    validate_request(_req(), _router())
    with pytest.raises(InvalidArgument, match=r"^request\.prompt_token_ids:"):
        validate_request(_req(prompt=[]), _router(), prefix="request.")


def test_config_reads_deployments_and_names_bad_fields():
    tables = [
        {"name": "short", "replicas": 2, "max_output_tokens": 64},
        {"name": "long", "tensor_parallel": 2},
    ]
    cfg = load_config(
        RouterConfig, "INFERENCE_ROUTER", {"LOOPRL_INFERENCE_ROUTER_DEPLOYMENTS": json.dumps(tables)}
    )
    specs = cfg.deployments
    assert [(s.name, s.replicas, s.tensor_parallel) for s in specs] == [("short", 2, 1), ("long", 1, 2)]

    def refusal(name: str, value: str) -> str:
        with pytest.raises(ConfigError) as err:
            load_config(RouterConfig, "INFERENCE_ROUTER", {f"LOOPRL_INFERENCE_ROUTER_{name}": value})
        return str(err.value)

    assert refusal("DEPLOYMENTS", json.dumps([{"name": "x", "replicaz": 1}])).startswith(
        "LOOPRL_INFERENCE_ROUTER_DEPLOYMENTS[0].replicaz: unknown field (known: "
    )
    assert refusal("DEPLOYMENTS", json.dumps([{"replicas": "2"}])) == (
        "LOOPRL_INFERENCE_ROUTER_DEPLOYMENTS[0].replicas: expected an integer, got str '2'"
    )
    assert refusal("DEPLOYMENTS", json.dumps([{"name": "a"}, {"name": "a"}])) == (
        "LOOPRL_INFERENCE_ROUTER_DEPLOYMENTS[1].name: duplicate deployment name 'a'"
    )
    assert refusal("VERSION_UNAVAILABLE_CODE", "NOPE") == (
        "LOOPRL_INFERENCE_ROUTER_VERSION_UNAVAILABLE_CODE: must be one of 'FAILED_PRECONDITION' or "
        "'UNAVAILABLE', got 'NOPE'"
    )
