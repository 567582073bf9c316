"""The configuration schema's building blocks, shared by run recipes and service configs.

Every recipe section and service config is a pydantic model deriving from `Schema`: a field's type,
default, constraint and docstring sit together, unknown fields are refused, and a float must be
finite. `explain` turns pydantic's errors into one line that names the dotted field path and what is
allowed; `field_rows` lists a model's fields (recursively) for `--help` and docs/configuration.md.
Imports nothing heavy: entry points parse their config before torch or Ray load.
"""

from __future__ import annotations

import re
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError, PydanticUndefined


class Schema(BaseModel):
    """Base of every configuration model: unknown fields and non-finite floats are errors, and each
    field's docstring is its documentation."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)


def field_error(path: str, message: str) -> PydanticCustomError:
    """An error a model validator raises about one of its fields (`path` relative to the model, e.g.
    "max_prompt_tokens" or "deployments[1].name"), so the message names the field's full path."""
    return PydanticCustomError("looprl_field", "{message}", {"message": message, "field": path})


def _join(path: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    return f"{path}.{part}" if path else part


def error_path(loc: tuple[str | int, ...], ctx: dict[str, Any] | None = None) -> str:
    path = ""
    for part in loc:
        path = _join(path, part)
    extra = (ctx or {}).get("field")
    if extra:
        path = f"{path}{extra}" if extra.startswith(("[", ".")) else _join(path, extra)
    return path


def _model_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The model class a location points into (for the known fields of an unknown-field error)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if (
            not (isinstance(current, type) and issubclass(current, BaseModel))
            or part not in current.model_fields
        ):
            return None
        current = _inner_model(current.model_fields[part].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _inner_model(tp: Any) -> Any:
    """The model inside `tp` (itself, or the element of a list/dict of models), else tp."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        inner = _inner_model(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return tp


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "a table",
    "model_type": "a table",
    "model_attributes_type": "a table",
}


def _describe_error(error: Any, model: type[BaseModel]) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "extra_forbidden":
        known = _model_at(model, error["loc"][:-1])
        names = ", ".join(sorted(known.model_fields)) if known is not None else ""
        return f"unknown field (known: {names})" if names else "unknown field"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}, got {value!r}"
    if kind == "missing":
        return "is required"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        op = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}[
            kind
        ]
        bound = next(v for k, v in ctx.items() if k in ("ge", "le", "gt", "lt"))
        return f"must be {op} {bound}, got {value}"
    if kind == "finite_number":
        return f"must be a finite number, got {value}"
    if kind in ("too_short", "too_long"):
        return error["msg"][0].lower() + error["msg"][1:]
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}, got {type(value).__name__} {value!r}"
    message = error["msg"]
    return message.removeprefix("Value error, ")


def explain(exc: ValidationError, model: type[BaseModel], root: str = "") -> str:
    """The first error of `exc` as "dotted.path: what is wrong (and what is allowed)"; `root` names
    the whole input when the error is not about one field."""
    error = exc.errors()[0]
    path = error_path(tuple(error["loc"]), error.get("ctx"))
    return f"{path or root}: {_describe_error(error, model)}"


@dataclass(frozen=True)
class FieldRow:
    """One documented field: its dotted path, type, default, bounds and docstring."""

    path: str
    type: str
    default: str
    bounds: str
    doc: str


def type_name(tp: Any) -> str:
    """A short readable spelling of a field's type ("int", "'cpu' | 'vllm'", "list[float]")."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Annotated:
        return type_name(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join("..." if a is Ellipsis else type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _bounds(metadata: list[Any]) -> str:
    parts = []
    for item in metadata:
        for cls, op, attr in ((Ge, ">=", "ge"), (Gt, ">", "gt"), (Le, "<=", "le"), (Lt, "<", "lt")):
            if isinstance(item, cls):
                parts.append(f"{op} {getattr(item, attr)}")
        describe = getattr(item, "describe_bound", None)
        if describe is not None:
            parts.append(describe())
    return ", ".join(parts)


def field_rows(model: type[BaseModel], prefix: str = "") -> list[FieldRow]:
    """Every field of `model`, nested models expanded ("deployments[].name", "reward_models.<key>.model")."""
    rows = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        tp = info.annotation
        inner = _inner_model(tp)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            origin = typing.get_origin(tp)
            suffix = "[]." if origin is list else ".<key>." if origin is dict else "."
            rows.extend(field_rows(inner, path + suffix))
            continue
        shown = (
            info.json_schema_extra.get("shown_default") if isinstance(info.json_schema_extra, dict) else None
        )
        if shown is not None:
            default = str(shown)  # a default read from the environment
        elif info.default_factory is not None:
            default = repr(info.default_factory())  # type: ignore[call-arg]
        elif info.default is PydanticUndefined:
            default = "(required)"
        else:
            default = repr(info.default)
        doc = " ".join((info.description or "").split())
        rows.append(FieldRow(path, type_name(tp), default, _bounds(info.metadata), doc))
    return rows


def parse(model: type[BaseModel], data: Any, error: type[Exception], root: str, **context: Any) -> Any:
    """`model` validated from `data`, any error raised as `error` with the field's dotted path."""
    try:
        return model.model_validate(data, context=context or None)
    except ValidationError as exc:
        raise error(explain(exc, model, root)) from None


def env_variable(prefix: str, path: str) -> str:
    """The environment variable that sets a service config's field (a nested group's field as
    GROUP__FIELD; anything inside a list or table is part of its top field's JSON)."""
    top = re.split(r"\[|\.<", path)[0]
    return f"LOOPRL_{prefix}_" + "__".join(part.upper() for part in top.split("."))


def help_text(model: type[BaseModel], env_prefix: str = "") -> str:
    """Every field of `model` with its type, default, bounds and docstring, as --help prints them;
    with `env_prefix`, under the environment variable that sets it."""
    lines = []
    for row in field_rows(model):
        name = env_variable(env_prefix, row.path) if env_prefix else row.path
        if env_prefix and ("[" in row.path or "<" in row.path):
            name = f"{name} (JSON) {row.path}"
        bounds = f"  ({row.bounds})" if row.bounds else ""
        lines.append(f"  {name}: {row.type} = {row.default}{bounds}")
        lines.extend(textwrap.wrap(row.doc, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def markdown_table(
    model: type[BaseModel], env_prefix: str = "", exclude: frozenset[str] = frozenset()
) -> str:
    """The fields of `model` (but the top-level ones in `exclude`) as a Markdown table
    (docs/configuration.md)."""
    head = "variable" if env_prefix else "field"
    out = [f"| {head} | type | default | bounds | description |", "|---|---|---|---|---|"]
    for row in field_rows(model):
        if re.split(r"[.\[]", row.path)[0] in exclude:
            continue
        name = env_variable(env_prefix, row.path) if env_prefix else row.path
        if env_prefix and ("[" in row.path or "<" in row.path):
            name = f"{name} `{row.path}`"
        cells = [f"`{name}`", row.type, f"`{row.default}`", row.bounds, row.doc]
        out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(out)
