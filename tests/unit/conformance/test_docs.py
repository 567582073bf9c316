"""The kit is written from the contracts: every case cites a proto element whose comment says what
the case checks, the generated table is fresh, and protos/ documents every RPC, field and value."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import conformance

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location(
        "gen_conformance_docs", ROOT / "tools" / "gen_conformance_docs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def comments(generator) -> dict:
    """protos/ as protoc reads it, comments included (one protoc run for the module)."""
    return generator.proto_comments()


def test_every_case_quotes_the_proto_comment_it_checks_and_the_table_is_fresh(generator, comments) -> None:
    assert generator.quote_problems(comments) == []
    page = (ROOT / "docs" / "conformance.md").read_text()
    assert page == generator.render(), (
        "docs/conformance.md is stale: run python tools/gen_conformance_docs.py"
    )


def test_protos_document_every_rpc_field_and_enum_value(generator, comments) -> None:
    assert generator.undocumented(comments) == []


def test_a_missing_quote_is_reported_naming_the_case(generator, comments) -> None:
    comments = dict(comments)
    name = "looprl.reward.v1.ScoreResponse.score"
    kind, _ = comments[name]
    comments[name] = (kind, "The reward.")
    problems = generator.quote_problems(comments)
    assert any(p.startswith("reward.score.finite:") and name in p for p in problems), problems


def test_every_contract_has_cases_of_every_kind_it_promises() -> None:
    ids = set()
    for name in conformance.NAMES:
        contract = conformance.contract(name)
        cases = [c.id for c in contract.cases]
        assert len(set(cases)) == len(cases)
        assert all(c.startswith(name + ".") for c in cases)
        kinds = {c.split(".")[1] for c in cases}
        assert {"health", "reflection", "auth", "malformed"} <= kinds, name
        assert any(c.status not in ("OK",) for c in contract.cases), f"{name}: no error case"
        ids.update(cases)
    assert len(ids) > 120
