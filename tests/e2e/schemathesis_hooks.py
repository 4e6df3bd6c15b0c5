"""Schemathesis hooks for the fuzz run: generate requests for the model the server serves."""

from __future__ import annotations

from typing import Any

import schemathesis

SERVED_MODEL = "default"


@schemathesis.hook
def before_load_schema(context: schemathesis.HookContext, raw_schema: dict[str, Any]) -> None:
    """Name the served model in every request body's `model` field, so that generation is reached, not a 404."""
    for component in raw_schema.get("components", {}).get("schemas", {}).values():
        model = component.get("properties", {}).get("model")
        if model is not None and model.get("type") == "string":
            model["enum"] = [SERVED_MODEL]
