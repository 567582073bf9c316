"""`python -m <service> --help`: a service's settings, from its config class, without importing
anything heavy (the config modules import only the kit's config and recipe code).

The rows come from services.kit.config.describe (field, default, help); the type of each field is
added here, from the class's annotations.
"""

from __future__ import annotations

import textwrap
import typing

from services.kit.config import describe
from services.kit.registry import ServiceSpec


def type_names(cls: type) -> dict[str, str]:
    """field -> its annotated type as written (`int`, `str | None`, `dict[str, dict]`)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve still has a name
        hints = dict(getattr(cls, "__annotations__", {}))
    return {name: _name(tp) for name, tp in hints.items()}


def _name(tp: object) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def settings_help(spec: ServiceSpec) -> str:
    cls = spec.config_class()
    types = type_names(cls)
    lines = [
        f"usage: python -m {spec.package}",
        "",
        f"The {spec.name} service. Settings are environment variables: {spec.env_var('<FIELD>')}, or the",
        "shared LOOPRL_<FIELD> for every service.",
        "",
        f"settings ({cls.__module__}.{cls.__qualname__}):",
    ]
    for field, default, help_text in describe(cls):
        lines.append(f"  {field}: {types.get(field, '?')} = {default}")
        lines.append(f"      {spec.env_var(field)}")
        lines.extend(textwrap.wrap(help_text, 96, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)
