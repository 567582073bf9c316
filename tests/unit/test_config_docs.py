"""docs/configuration.md is what the configuration schema renders, so it cannot drift from the code."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_page_is_generated_from_the_schema() -> None:
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "tools" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == generator.render(), "docs/configuration.md is stale: run python tools/gen_config_docs.py"
    # Every recipe field and service variable is on it, with its documentation.
    assert "| `max_turns` | int | `1` | >= 1, <= 1024 | Most model turns in one episode" in page
    assert "`LOOPRL_ENV_SANDBOX__WARM_WORKERS` | int | `2` | >= 0 | Sandbox workers kept" in page
