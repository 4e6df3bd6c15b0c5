"""The access log of generation requests: who a request says it is for, never a metric label.

OpenAI's `user` and `safety_identifier` (an end user's id), `prompt_cache_key`, `service_tier` and
`metadata` go to one INFO line of the `statelm.access` logger per request, values JSON-quoted so that no
client text can forge a line.
"""

from __future__ import annotations

import json
import logging

from statelm.api.protocol import GenerationRequest

log = logging.getLogger("statelm.access")
LOGGED_FIELDS = ("user", "safety_identifier", "prompt_cache_key", "service_tier", "metadata")


def log_request(request_id: str, request: GenerationRequest) -> None:
    """One access log line for a generation request: its id, model and the tags it carries."""
    tags = {name: getattr(request, name, None) for name in LOGGED_FIELDS}
    fields = " ".join(f"{name}={json.dumps(value)}" for name, value in tags.items() if value is not None)
    log.info("%s model=%s %s", request_id, json.dumps(request.model), fields)
