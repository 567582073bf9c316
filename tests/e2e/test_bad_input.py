"""Bad input against the running stack: the OpenAI-compatible endpoints answer out-of-range fields
with OpenAI-shaped 400s naming the field (the gateway's own checks, and the router's translated to
OpenAI field names) and keep forwarding valid requests; `looprl restart` with an unknown name fails
cleanly and stops nothing; a gateway refusal reaches the CLI user as one line, not a traceback."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.slow


def _post(stack, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{stack.state.http_port}{path}", data=json.dumps(body).encode()
    )
    request.add_header("Authorization", f"Bearer {stack.state.gateway_token}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


BAD = [
    ("/v1/completions", {"prompt": [1, 2**40]}, "prompt", "prompt[1]: token id 1099511627776"),
    ("/v1/completions", {"prompt": "12", "max_tokens": 10**12}, "max_tokens", "must be in [1, 131072]"),
    # Within the cluster limit but longer than any deployment's model: the router's, renamed.
    (
        "/v1/completions",
        {"prompt": "12", "max_tokens": 100000},
        "max_tokens",
        "max_tokens: prompt + max_tokens",
    ),
    ("/v1/completions", {"prompt": "12", "seed": 2**70}, "seed", "must be in [0, 9223372036854775807]"),
    ("/v1/completions", {"prompt": "12", "n": -1}, "n", "must be in [1, 128]"),
    ("/v1/completions", {"prompt": "12", "temperature": "warm"}, "temperature", "must be a number"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "12"}], "seed": 2**70},
        "seed",
        "seed",
    ),
]


def test_openai_endpoints_refuse_out_of_range_fields_with_400_and_keep_serving(stack) -> None:
    for path, body, param, text in BAD:
        status, reply = _post(stack, path, body)
        assert status == 400, (path, body, reply)
        error = reply["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            param,
            "INVALID_ARGUMENT",
        )
        assert text in error["message"], (body, error)
    # Still serving and forwarding: valid requests reach the router, which (no run has pushed weights
    # to this stack) answers that no replica is synced yet, in the same OpenAI shape.
    valid = [
        ("/v1/completions", {"prompt": "12", "max_tokens": 4, "seed": 2**63 - 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "12"}], "max_tokens": 4, "n": 2}),
    ]
    for path, body in valid:
        status, reply = _post(stack, path, body)
        assert status == 503 and reply["error"]["code"] == "UNAVAILABLE", reply
        assert "replica" in reply["error"]["message"]


def test_restart_of_an_unknown_service_names_the_real_ones(stack) -> None:
    result = stack.looprl("restart", "nope")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "unknown service 'nope'" in result.stderr
    assert all(svc.name in result.stderr for svc in stack.state.services)
    assert stack.looprl("status").returncode == 0  # nothing was stopped


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("watch", "nope"), "looprl: NOT_FOUND: run_id: no run 'nope'\n"),
        (("stop", "nope"), "looprl: NOT_FOUND: run_id: no run 'nope'\n"),
        (("--token", "not-the-token", "runs"), "looprl: UNAUTHENTICATED: invalid bearer token\n"),
    ],
    ids=["watch", "stop", "token"],
)
def test_the_cli_says_what_the_gateway_refused_in_one_line(stack, args, said) -> None:
    result = stack.looprl(*args)
    assert (result.returncode, result.stderr) == (1, said)
