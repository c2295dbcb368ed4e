"""The config's building blocks: the strict base section, ConfigError, and error messages in the
config's own words (the key's dotted path, its value, the expected JSON form). Every config section
(schema.py, zero_optimization.py, optimizer.py, scheduler.py, monitor.py) is a `_Section`.
"""

from __future__ import annotations

import difflib
import json
import types
from typing import Annotated, Any, Iterable, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]


class ConfigError(ValueError):
    """A config problem, said in terms of the config's own keys."""


class _Section(BaseModel):
    # A misspelt key must be an error, not a silently ignored setting; so must a value of the wrong
    # JSON type (strict): "yes" is not a boolean, true is not a batch size, "2" is not a stage, the
    # string "1e-3" is not a number. An integer is still a number where a float is expected. No
    # key means anything by inf or nan (an inf loss scale or clip would be trained with, not refused).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _integral_float_as_int(cls, value: Any, info: ValidationInfo) -> Any:
        # JSON configs write sizes as 5e8, which JSON parsers read as a float: a whole float is
        # accepted where an integer is expected (5.5 is still an error).
        wants_int = _expects_int(cls.model_fields[info.field_name].annotation)
        if isinstance(value, float) and value.is_integer() and wants_int:
            return int(value)
        return value


def _expects_int(annotation: Any) -> bool:
    """True for int, Annotated[int, ...] and their optional forms (not bool, not float)."""
    if annotation is int:
        return True
    origin = get_origin(annotation)
    if origin is Annotated:
        return _expects_int(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return any(_expects_int(a) for a in get_args(annotation))
    return False


_AUTO = "'auto' is a placeholder the Hugging Face Trainer fills in; give"


def _unknown_key(path: str, known: Iterable[str]) -> str:
    known = list(known)
    close = difflib.get_close_matches(path.rsplit(".", 1)[-1], known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known keys are {', '.join(known)}"
    return f"unknown config key {path!r}; {hint}"


def _section_at(model: type[BaseModel], loc: Iterable[str]) -> type[BaseModel] | None:
    """The section model that `loc` names inside `model`, or None if loc names a plain value."""
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return None
        args = (field.annotation, *getattr(field.annotation, "__args__", ()))
        sections = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if not sections:
            return None
        model = sections[0]
    return model


# The strict types' expected forms, in JSON's words.
_EXPECTED = {
    "bool_type": "true or false (a JSON boolean, not a string or a number)",
    "int_type": "an integer (a JSON number without a fraction, not a string or a boolean)",
    "float_type": "a number (a JSON number, not a string or a boolean)",
}


def _format_error(err: dict[str, Any], model: type[BaseModel], prefix: str) -> str:
    loc = [str(part) for part in err["loc"]]
    path = ".".join(([prefix] if prefix else []) + loc)
    kind, value = err["type"], err["input"]
    if kind == "extra_forbidden":
        return _unknown_key(path, _section_at(model, loc[:-1]).model_fields)
    if kind == "missing":
        return f"config key {path!r} is required"
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):  # raised by a nested check that already names its keys
        return str(cause)
    if isinstance(value, str) and value == "auto":
        return f"config key {path!r} = \"auto\": {_AUTO} {'a boolean' if kind.startswith('bool') else 'a number'}"
    if cause is not None:
        problem = str(cause)
    elif kind in _EXPECTED:
        problem = "expected " + _EXPECTED[kind]
    else:
        problem = "expected " + err["msg"].removeprefix("Input should be ")
    if cause is not None and _section_at(model, loc) is not None:  # a check across a section's keys
        return f"config section {path!r}: {problem}" if path else problem
    return f"config key {path!r} = {json.dumps(value, default=repr)}: {problem}"


def _format_errors(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    return "\n".join(_format_error(err, model, prefix) for err in exc.errors())

