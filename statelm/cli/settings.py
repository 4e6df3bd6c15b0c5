"""`statelm serve`'s options, one per field of EngineConfig, ServerConfig and ClusterConfig, and the configs their
values make."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from statelm.config import SETTING, ClusterConfig, EngineConfig, ServerConfig, Setting

CONFIGS: dict[type[Any], str] = {EngineConfig: "Engine", ServerConfig: "Server", ClusterConfig: "Cluster"}  # panels
Command = TypeVar("Command", bound=Callable[..., Any])
Config = TypeVar("Config")


@dataclasses.dataclass(frozen=True)
class Option:
    """A config field as a `statelm serve` option."""

    field: dataclasses.Field[Any]
    setting: Setting
    kind: Any  # the field's type, without None

    @property
    def name(self) -> str:
        """The field's name, which is also the option's parameter name."""
        return self.field.name

    @property
    def by_factory(self) -> bool:
        """Whether the field's default is made by a factory (and so the option's None leaves the field out)."""
        return self.field.default_factory is not dataclasses.MISSING

    @property
    def default(self) -> Any:
        """What the option is when left out: the default as typed, None for a default made by a factory."""
        if self.by_factory:
            return None
        if self.field.default is None and self.setting.zero_is_none:
            return 0
        return self.field.default if self.setting.text_default is None else self.setting.text_default

    def parameters(self, panel: str) -> list[inspect.Parameter]:
        """The command parameters typer reads this option (and its switch, if it has one) from."""
        parameters = [self._parameter(panel)]
        switch = self.setting.switch
        if switch is not None:
            option = typer.Option(f"{switch.flag}/{switch.off_flag}", help=switch.help, rich_help_panel=panel)
            parameters.append(
                inspect.Parameter(
                    self.switch_name, inspect.Parameter.KEYWORD_ONLY, default=True, annotation=Annotated[bool, option]
                )
            )
        return parameters

    @property
    def switch_name(self) -> str:
        """The parameter name of the option's switch (its flag as an identifier); empty without a switch."""
        switch = self.setting.switch
        return "" if switch is None else switch.flag.removeprefix("--").replace("-", "_")

    def _parameter(self, panel: str) -> inspect.Parameter:
        """The command parameter typer reads this option from."""
        repeatable = typing.get_origin(self.kind) is list
        typed = str if self.setting.parse else self.kind
        name = self.setting.flag or f"--{self.name.replace('_', '-')}"
        option = typer.Option(
            f"{name}/--no-{name.removeprefix('--')}" if typed is bool else name,
            help=self.setting.help,
            parser=_reporting_errors(self.setting.parse, name) if self.setting.parse else None,
            min=self.setting.minimum,
            max=self.setting.maximum,
            show_default=not repeatable,
            rich_help_panel=panel,
        )
        annotation = typed if self.default is not None else typed | None
        return inspect.Parameter(
            self.name, inspect.Parameter.KEYWORD_ONLY, default=self.default, annotation=Annotated[annotation, option]
        )

    def value(self, values: dict[str, Any], ctx: typer.Context | None = None) -> Any:
        """The field's value from the options' (parsed) values by name; None where the field's factory makes it.

        A switch turned off sets its value, which contradicts another value given to the option itself (on the command
        line or by the environment of ctx, the running command).
        """
        given = values[self.name]
        switch = self.setting.switch
        if switch is not None and not values.get(self.switch_name, True):
            source = ctx.get_parameter_source(self.name) if ctx is not None else None
            if given != switch.off and source is not None and source.name != "DEFAULT":
                flag = self.setting.flag or f"--{self.name.replace('_', '-')}"
                raise typer.BadParameter(f"{switch.off_flag} means {switch.off}; it contradicts {flag} {given}")
            return switch.off
        if self.setting.env:
            given = [*(given or []), *os.environ.get(self.setting.env, "").split()]
        return None if self.setting.zero_is_none and given == 0 else given


def _reporting_errors(parse: Callable[[str], Any], flag: str) -> Callable[[str], Any]:
    """parse, its ValueError reported as a bad value of the option flag."""

    @functools.wraps(parse)
    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint=f"'{flag}'") from None

    return read


def options(config: type[Any]) -> list[Option]:
    """The `statelm serve` options of config's fields (every field has a Setting; some are marked not options)."""
    hints = typing.get_type_hints(config)
    found = []
    for field in dataclasses.fields(config):
        if SETTING not in field.metadata:
            raise TypeError(f"{config.__name__}.{field.name} is not declared with statelm.config.setting()")
        setting: Setting = field.metadata[SETTING]
        if setting.cli:
            found.append(Option(field, setting, _without_none(hints[field.name])))
    return found


def _without_none(hint: Any) -> Any:
    """`X` from `X | None`; any other type as it is."""
    if isinstance(hint, types.UnionType):
        return next(kind for kind in typing.get_args(hint) if kind is not types.NoneType)
    return hint


def with_setting_options(command: Command) -> Command:
    """command, whose `**settings` takes them, with an option per setting of every config in CONFIGS."""
    signature = inspect.signature(command, eval_str=True)
    own = [p.replace(kind=p.KEYWORD_ONLY) for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    generated = [
        parameter
        for config, panel in CONFIGS.items()
        for option in options(config)
        for parameter in option.parameters(panel)
    ]
    command.__signature__ = signature.replace(parameters=[*generated, *own])  # type: ignore[attr-defined]
    return command


def configs(values: dict[str, Any], ctx: typer.Context | None = None) -> tuple[EngineConfig, ServerConfig]:
    """The engine and server configs the options' values (by field name) of the command ctx set."""
    return config_from(EngineConfig, values, ctx), config_from(ServerConfig, values, ctx)


def config_from(config: type[Config], values: dict[str, Any], ctx: typer.Context | None = None) -> Config:
    """The config of that type the options' values (by field name) of the command ctx set."""
    chosen = [(option, option.value(values, ctx)) for option in options(config)]
    return config(**{option.name: value for option, value in chosen if value is not None or not option.by_factory})
