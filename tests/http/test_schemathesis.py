"""Schemathesis fuzzes every route from the app's own OpenAPI schema: no 5xx, every response as documented.

The app is the tiny model in-process, called through schemathesis' ASGI transport (which runs its lifespan), and
the run is what `schemathesis run` executes: its engine, with the same settings, failing on what fails the CLI.
Positive and negative cases from the examples, coverage and fuzzing phases, with a fixed seed and a bounded
number of examples per operation. Every check runs except `positive_data_acceptance`: some schema-valid
requests are rightly refused with 400 for reasons a schema cannot state (a rollback past the end of the
transcript, `stream_options` without `stream`, a prompt longer than the context).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events, from_schema
from schemathesis.python.asgi import shutdown_lifespans

from tests.http.conftest import SERVED_NAME, built_app, tiny_args

KEY = "fuzz-key-0123456789"
AUTHORIZATION = {"Authorization": f"Bearer {KEY}"}
SERVE_ARGS = ["--max-model-len", "128", "--max-completion-tokens", "16", "--api-key", KEY]


@schemathesis.hook
def before_load_schema(context: schemathesis.HookContext, raw_schema: dict[str, Any]) -> None:
    """Name the served model in every request body's `model` field, so that generation is reached, not a 404."""
    for component in raw_schema.get("components", {}).get("schemas", {}).values():
        model = component.get("properties", {}).get("model")
        if model is not None and model.get("type") == "string":
            model["enum"] = [SERVED_NAME]


def fuzz_config() -> SchemathesisConfig:
    """What `schemathesis run` was given: phases, checks, examples, seed, timeouts and the key header."""
    config = SchemathesisConfig()
    config.update(seed=20261122, max_failures=None)
    project = config.projects.override
    project.update(headers=AUTHORIZATION, request_timeout=120)
    project.phases.update(phases=["examples", "coverage", "fuzzing"])
    project.checks.update(
        included_check_names=["all"], excluded_check_names=["positive_data_acceptance"], max_response_time=120
    )
    project.generation.update(max_examples=5, no_shrink=True, database="none")
    return config


@pytest.fixture(scope="module")
def fuzzed_schema(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The app's schema as schemathesis loads it, calls going to the app in-process."""
    with built_app(tiny_args(tiny_model, tmp_path_factory.mktemp("fuzz") / "state", *SERVE_ARGS)) as app:
        try:
            yield schemathesis.openapi.from_asgi("/openapi.json", app, config=fuzz_config(), headers=AUTHORIZATION)
        finally:
            shutdown_lifespans()


def failures_of(event: events.EngineEvent) -> list[str]:
    """What in one engine event fails a `schemathesis run`: a failed or erroring scenario, phase, or error."""
    if isinstance(event, events.ScenarioFinished) and event.status in (Status.FAILURE, Status.ERROR):
        checks = [check for checks in event.recorder.checks.values() for check in checks]
        failed = [check.failure_info for check in checks if check.failure_info is not None]
        found = [f"{info.failure.title}: {info.failure.message}\n{info.code_sample}" for info in failed]
        return [f"{event.label} ({event.phase.value}): {event.status.value}", *found]
    if isinstance(event, events.PhaseFinished) and event.status in (Status.FAILURE, Status.ERROR):
        return [f"phase {event.phase.name.value}: {event.status.value}"]
    if isinstance(event, events.NonFatalError):
        return [f"{event.label}: {event.info.message}"]
    if isinstance(event, events.FatalError):
        return [f"fatal: {event.exception!r}"]
    if isinstance(event, events.EngineFinished):
        return [str(failure) for failure in event.failures]
    return []


def test_fuzzing_finds_no_server_error_and_no_response_off_the_schema(fuzzed_schema: Any) -> None:
    failures: list[str] = []
    cases = 0
    for event in from_schema(fuzzed_schema).execute():
        failures += failures_of(event)
        if isinstance(event, events.ScenarioFinished):
            cases += len(event.recorder.cases)
    assert not failures, "\n\n".join(failures)[-12000:]
    assert cases > 0
