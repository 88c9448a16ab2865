"""The OpenAI surface's output constraints as the engine's one ``Constraint``.

A request names at most one, in any of the fields clients send:

- OpenAI's ``response_format``: ``{"type": "json_object"}`` or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
  (``{"type": "text"}``: none);
- vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
  ``grammar``, ``json_object``) and its older ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``.

Two of them at once is a 400 naming the second; a malformed one a 400
naming its field. Whether the constraint compiles is the engine's to say
(``inference.constraints``): its INVALID_ARGUMENT comes back as a 400.
"""

from __future__ import annotations

import json
from typing import Any

from kvd.common.field_error import FieldError
from kvd_api.engine.v1 import engine_pb2 as epb

_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def constraint_of(body: Any) -> epb.Constraint | None:
    """The request's constraint (None: unconstrained)."""
    found: list[tuple[str, epb.Constraint]] = []
    if body.response_format is not None and (c := _response_format(body.response_format)) is not None:
        found.append(("response_format", c))
    for kind in ("json", "regex", "choice", "grammar"):
        if (value := getattr(body, f"guided_{kind}", None)) is not None:
            found.append((f"guided_{kind}", _of_kind(kind, value, f"guided_{kind}")))
    if (structured := body.structured_outputs) is not None:
        found += _structured(structured)
    if len(found) > 1:
        raise FieldError(found[1][0], f"{found[1][0]}: give one output constraint; {found[0][0]} is one already")
    return found[0][1] if found else None


def _response_format(fmt: dict[str, Any]) -> epb.Constraint | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return epb.Constraint(json_object=True)
    if kind != "json_schema":
        raise FieldError("response_format", f"response_format.type: {kind!r}; give text, json_object or json_schema")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise FieldError("response_format", "response_format.json_schema: give an object with a schema object")
    # OpenAI's schema is optional: without one, any JSON object.
    if "schema" not in spec:
        return epb.Constraint(json_object=True)
    return epb.Constraint(json_schema=json.dumps(spec["schema"]))


def _structured(value: Any) -> list[tuple[str, epb.Constraint]]:
    if not isinstance(value, dict):
        raise FieldError("structured_outputs", "structured_outputs: give an object")
    out = []
    for kind in _STRUCTURED_KINDS:
        if value.get(kind) is not None and value.get(kind) is not False:
            field = f"structured_outputs.{kind}"
            out.append((field, _of_kind(kind, value[kind], field)))
    return out


def _of_kind(kind: str, value: Any, field: str) -> epb.Constraint:
    if kind == "json":
        if isinstance(value, str):
            return epb.Constraint(json_schema=value)
        if isinstance(value, dict):
            return epb.Constraint(json_schema=json.dumps(value))
        raise FieldError(field, f"{field}: give a JSON schema (an object, or its JSON text)")
    if kind == "json_object":
        return epb.Constraint(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise FieldError(field, f"{field}: give a list of strings")
        return epb.Constraint(choice=epb.Choices(options=value))
    if not isinstance(value, str):
        raise FieldError(field, f"{field}: give a string")
    return epb.Constraint(regex=value) if kind == "regex" else epb.Constraint(grammar=value)
