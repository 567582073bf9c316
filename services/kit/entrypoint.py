"""The thin `python -m <service>` entry point: parse typed config first (a bad setting fails in
milliseconds, before torch or Ray are imported), then import the service and serve.

Every service's __main__.py is `sys.exit(run_service("<name>"))`: what to load and run comes from
its entry in services/kit/config/registry.py. `--help` lists the settings and exits before anything heavy
is imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from services.kit.config.registry import ServiceSpec, service
from services.kit.config.service import ConfigError, ServiceConfig, load_config

HELP_FLAGS = ("-h", "--help")


def run_service(name: str, argv: Sequence[str] | None = None) -> int:
    """Run registry service `name`: load and validate its config from LOOPRL_<prefix>_* variables,
    then import and await its serve(config). Returns the process exit code (2 on a config
    error or an unknown argument, 0 after --help)."""
    spec = service(name)
    args = list(sys.argv[1:] if argv is None else argv)
    if any(arg in HELP_FLAGS for arg in args):
        return _print_help(spec)
    if args:
        print(
            f"{name}: unexpected arguments {args}; settings are environment variables (see --help)",
            file=sys.stderr,
        )
        return 2
    try:
        config = load(spec)
    except ConfigError as exc:
        print(f"{name}: configuration error: {exc}", file=sys.stderr)
        return 2
    import asyncio  # after --help and the config: neither needs it

    from services.kit.ray import head_loss as ray_head

    ray_head.restart_on_loss(dict(os.environ), exit_instead=config.on_ray_head_loss == "exit")
    asyncio.run(spec.serve_function()(config))
    return 0


def settings_help(spec: ServiceSpec) -> str:
    """The service's settings: every field of its config with its type, default, bounds and doc,
    under the environment variable that sets it."""
    from services.kit.config.schema import help_text

    cls = spec.config_class()
    return "\n".join(
        [
            f"usage: python -m {spec.package}",
            "",
            f"The {spec.name} service. Settings are environment variables ({spec.env_var('<FIELD>')}, or",
            "the shared LOOPRL_<FIELD>; a nested group's field is <VARIABLE>__<FIELD>); docs/configuration.md.",
            "",
            f"settings ({cls.__module__}.{cls.__qualname__}):",
            help_text(cls, spec.env_prefix),
        ]
    )


def _print_help(spec: ServiceSpec) -> int:
    try:
        print(settings_help(spec), flush=True)
    except BrokenPipeError:  # `--help | head`: the reader has what it wanted
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


def load(spec: ServiceSpec) -> ServiceConfig:
    """The service's config from the environment, checked; ConfigError names what is wrong."""
    from services.kit.rpc import tls  # grpc: not needed for --help

    config: ServiceConfig = load_config(spec.config_class(), spec.env_prefix)
    # Before the service opens any channel: without certificates (and no explicit opt-out) the
    # process stops here, with the variables to set.
    tls.configure(spec.name, config)
    return config
