"""`statelm serve`'s options are the fields of EngineConfig, ServerConfig and ClusterConfig: names, help and
defaults."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import typer
from typer.testing import CliRunner

from statelm.cli.main import app
from statelm.cli.settings import CONFIGS, config_from, options
from statelm.config import SETTING, ClusterConfig, EngineConfig, ServerConfig, SessionDurability
from statelm.engine.builder import step_token_budget
from statelm.server import launch

FIELDS = [(config, field) for config in CONFIGS for field in dataclasses.fields(config)]
KEY_VARIABLES = {"STATELM_API_KEY": None, "STATELM_ADMIN_KEY": None}


def serve_parameters() -> dict[str, Any]:
    """The click parameters of `statelm serve`, by name."""
    command = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    return {parameter.name: parameter for parameter in command.params}


def configs_of(args: list[str], environment: dict[str, str | None] | None = None) -> tuple[Any, Any]:
    """The configs `statelm serve args` would start a server with."""
    captured: list[tuple[Any, Any]] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "run_server", lambda engine, server: captured.append((engine, server)))
        result = CliRunner().invoke(app, ["serve", *args], env={**KEY_VARIABLES, **(environment or {})})
    assert result.exit_code == 0 and captured, result.output
    return captured[0]


@pytest.mark.parametrize(("config", "field"), FIELDS, ids=[f"{c.__name__}.{f.name}" for c, f in FIELDS])
def test_every_field_is_a_serve_option_or_marked_not_one(config: type, field: dataclasses.Field[Any]) -> None:
    assert SETTING in field.metadata, f"declare {config.__name__}.{field.name} with statelm.config.setting()"
    parameter = serve_parameters().get(field.name)
    if field.metadata[SETTING].cli:
        assert parameter is not None and parameter.help == field.metadata[SETTING].help
    else:
        assert parameter is None


def test_every_serve_option_is_a_field_or_a_fields_switch() -> None:
    fields = {option.name for config in CONFIGS for option in options(config)}
    switches = {option.switch_name for config in CONFIGS for option in options(config) if option.switch_name}
    assert switches == {"persist_sessions"}  # --no-persist-sessions: the old spelling of --session-durability off
    assert set(serve_parameters()) == fields | switches


@pytest.fixture(scope="module")
def left_out() -> dict[type, Any]:
    """The configs of `statelm serve` without options, by config class (ClusterConfig's from its options' defaults:
    without --replicas the single server starts, which takes no ClusterConfig)."""
    engine, server = configs_of([])
    defaults = {option.name: option.default for option in options(ClusterConfig)}
    return {EngineConfig: engine, ServerConfig: server, ClusterConfig: config_from(ClusterConfig, defaults)}


@pytest.mark.parametrize(("config", "field"), FIELDS, ids=[f"{c.__name__}.{f.name}" for c, f in FIELDS])
def test_an_option_left_out_is_the_field_default(
    config: type, field: dataclasses.Field[Any], left_out: dict[type, Any]
) -> None:
    assert getattr(left_out[config], field.name) == getattr(config(), field.name)


def test_options_set_fields_through_their_text_forms() -> None:
    args = ["--kv-cache-memory", "1GiB", "--no-prefix-cache", "--max-messages", "0", "--snapshot-quota", "1MiB"]
    args += ["--response-retention", "12h", "--api-key", "a", "--session-durability", "spill"]
    engine, server = configs_of(args, {"STATELM_API_KEY": "b c"})
    assert engine.kv_cache_memory == 2**30 and engine.enable_prefix_caching is False
    assert server.max_messages is None and server.snapshot_quota == 2**20 and server.response_retention == 43200
    assert server.api_keys == ["a", "b", "c"] and server.admin_keys == []
    assert server.session_durability is SessionDurability.SPILL


def test_a_bad_text_form_names_its_option() -> None:
    result = CliRunner().invoke(app, ["serve", "--snapshot-quota", "lots"], env=KEY_VARIABLES)
    assert result.exit_code == 2 and "--snapshot-quota" in result.output and "not a size" in result.output


def test_a_value_past_a_bound_names_its_option() -> None:
    assert configs_of(["--pinned-kv-fraction", "1"])[0].pinned_kv_fraction == 1.0
    result = CliRunner().invoke(app, ["serve", "--pinned-kv-fraction", "1.5"], env=KEY_VARIABLES)
    assert result.exit_code == 2 and "--pinned-kv-fraction" in result.output


def test_the_step_token_budget_is_the_option_else_the_devices_default() -> None:
    left_out = configs_of([])[0]
    assert left_out.max_num_batched_tokens is None
    assert step_token_budget(left_out, torch.device("cpu")) == 256
    assert step_token_budget(left_out, torch.device("cuda")) == 512
    chosen = configs_of(["--max-num-batched-tokens", "1024"])[0]
    assert step_token_budget(chosen, torch.device("cpu")) == step_token_budget(chosen, torch.device("cuda")) == 1024
    result = CliRunner().invoke(app, ["serve", "--max-num-batched-tokens", "0"], env=KEY_VARIABLES)
    assert result.exit_code == 2 and "--max-num-batched-tokens" in result.output
