"""The thin `python -m <service>` entry point: parse typed config first (a bad setting fails in
milliseconds, before torch or Ray are imported), then import the service and serve."""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from services.kit import tls
from services.kit.config import ConfigError, ServiceConfig, load_config


def run_service(
    name: str,
    config_cls: type[ServiceConfig],
    env_prefix: str,
    serve: str | Callable[[Any], Awaitable[None]],
) -> int:
    """Load config_cls from LOOPRL_<env_prefix>_* variables, then run `serve`: an async function
    taking the config, or "module:function" to import it only after the config parsed. Returns the
    process exit code (2 on a config error)."""
    try:
        config = load_config(config_cls, env_prefix)
        # Before the service opens any channel: without certificates (and no explicit opt-out)
        # the process stops here, with the variables to set.
        tls.configure(name, config)
    except ConfigError as exc:
        print(f"{name}: configuration error: {exc}", file=sys.stderr)
        return 2
    if isinstance(serve, str):
        module, _, function = serve.partition(":")
        serve = getattr(importlib.import_module(module), function)
    asyncio.run(serve(config))
    return 0
