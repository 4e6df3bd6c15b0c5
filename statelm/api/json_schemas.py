"""The JSON Schemas a request carries (tools' parameters, response formats, structured outputs), checked on
arrival against the JSON Schema meta-schema (jsonschema's, the draft a schema's `$schema` names, else 2020-12).

A wrong schema is then a 400 naming its field in the shape of the API that was called, as a request validation
error is, rather than a tool the model is shown but cannot call or a constraint that fails when it is compiled.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any

import jsonschema
from pydantic import AfterValidator

_CHECKED_SCHEMAS = 512  # distinct schemas whose verdict is remembered (an agent sends the same tools every turn)


def check_json_schema(schema: Any) -> Any:
    """schema itself if it is a valid JSON Schema (a JSON text of one, for fields that take text), else ValueError
    saying what is wrong and where in the schema."""
    text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
    problem = _problem(text)
    if problem:
        raise ValueError(problem)
    return schema


def check_parameters_schema(schema: dict[str, Any] | None, function: str | None) -> dict[str, Any] | None:
    """A function's parameters schema if it is a valid JSON Schema of an object (its arguments), else ValueError
    naming the function."""
    if schema is None:
        return None
    try:
        check_json_schema(schema)
    except ValueError as exc:
        raise ValueError(f"invalid schema for function {function!r}: {exc}") from None
    if schema.get("type", "object") != "object":
        raise ValueError(
            f"invalid schema for function {function!r}: its arguments are a JSON object, so its parameters must be a"
            f" schema of type 'object', not {schema['type']!r}"
        )
    return schema


@functools.lru_cache(maxsize=_CHECKED_SCHEMAS)
def _problem(text: str) -> str | None:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        return f"not a JSON text of a JSON Schema: {exc}"
    if not isinstance(schema, dict | bool):
        return f"a JSON Schema is an object or a boolean, not {type(schema).__name__}"
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(part) for part in exc.path)
        return f"not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else "")
    return None


JSONSchema = Annotated[dict[str, Any], AfterValidator(check_json_schema)]
JSONSchemaOrText = Annotated[dict[str, Any] | str, AfterValidator(check_json_schema)]  # vLLM takes both
