"""Helpers every `bcstack` command shares: one-line errors, settings loading, and `serve_command`.

`serve_command(SettingsClass, run, help=...)` is each service's `bcstack serve X`: one option
per setting (`cache_path` -> `--cache-path`) with the setting's description, default and
environment variable in `--help`, plus `--config FILE`; it loads the settings and calls
`run(settings)`. Mount it with `app.command("x", cls=ServeCommand)`. It is written by hand
because Typer has no pydantic-settings integration (a command's options come from a function
signature), and pydantic-settings' own CLI source is argparse, which cannot sit under the Typer
`bcstack` command line; so the function Typer reads gets its signature built from the fields.

Only values typed on the command line become overrides. Click also reads the environment
variables it shows; those values are dropped, so pydantic-settings stays the one reader of the
environment and `--config`: precedence, the misspelt-variable check and error messages naming
the variable stay as core/kit/settings.py has them. Every option takes the text its variable
would and the settings model validates it, so a bad value reads `invalid option --port: ...` as
a bad variable reads `invalid environment variable ...`; a boolean setting is a pair of flags,
`--log-json/--no-log-json`, as every boolean of the CLI is (its variable takes true or false).
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import NoDecode
from typer._click.exceptions import MissingParameter, UsageError  # Typer's own click (pyproject: 0.29+)
from typer.core import TyperCommand

from core.kit.settings import ServiceSettings, SettingsError, env_var_name, is_secret, load_settings

S = TypeVar("S", bound=ServiceSettings)

CONFIG_HELP = "YAML settings file; its keys are the setting names (an option or env var wins over it)."
# The option column of `bcstack serve X --help` (click's default: 30), narrow enough that the
# longest environment variable (48 characters) fits on one line of the help column at 80 columns,
# the width help gets when stdout is not a terminal.
OPTION_COLUMN = 24


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` to stderr and exit: what a user sees instead of a traceback."""
    sys.stderr.write(f"error: {message}\n")
    raise typer.Exit(code)


def need_file(option: str, path: Path | str) -> None:
    """`option`'s file is there, else one error line: checked before a command's heavy imports
    (torch, transformers: seconds) so that a mistyped path is refused at once."""
    if not Path(path).is_file():
        fail(f"{option} {path}: no such file")


def need_model(option: str, path: Path | str) -> None:
    """`option` names a Hugging Face model folder (its config.json), else one error line; cheap, as
    `need_file`."""
    if not (Path(path) / "config.json").is_file():
        fail(f"{option} {path}: not a model folder (no config.json)")


def load_or_fail(
    cls: type[S], config: Path | None, option_names: Mapping[str, str] | None = None, **overrides: Any
) -> S:
    """The settings, or a one-line failure; `option_names` (setting -> option) names an option in
    the error as the command calls it where that is not the setting's own name (`serve_command`)."""
    try:
        return load_settings(cls, config_file=config, **overrides)
    except SettingsError as e:
        message = str(e)
        for name, option in (option_names or {}).items():
            message = message.replace(f"option --{_kebab(name)}:", f"option {option}:")
        fail(message)


class Command(TyperCommand):
    """Every `bcstack` command: a missing-arguments error names every missing one, not the first.

    Click stops at the first required parameter it finds missing ("Missing option '--model'"),
    so a user fixes one, runs again and meets the next; this reads the whole command line first
    and names them all in one line. `bcstack.cli` gives this class to every command it mounts.
    """

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        given = list(args)  # click's parser consumes the list it is given
        try:
            return super().parse_args(ctx, args)
        except MissingParameter as first:
            missing = _missing(self, ctx, given)
            if len(missing) < 2:
                raise
            raise UsageError(f"Missing {_listed(missing)}.", ctx) from first


def _listed(params: list[Any]) -> str:
    """`argument 'path' and options '--model' and '--out'`: each kind once, in the command's order."""
    kinds: dict[str, list[str]] = {}
    for param in params:
        kinds.setdefault(param.param_type_name, []).append(param.get_error_hint())
    parts = [
        f"{kind}{'s' if len(hints) > 1 else ''} "
        + (", ".join(hints[:-1]) + " and " if len(hints) > 1 else "")
        + hints[-1]
        for kind, hints in kinds.items()
    ]
    return " and ".join(parts)


def _missing(command: TyperCommand, ctx: typer.Context, args: list[str]) -> list[Any]:
    """The required parameters of `command` that `args`, their env vars and defaults leave unset."""
    try:
        opts, _, _ = command.make_parser(ctx).parse_args(args=list(args))
    except UsageError:
        return []
    missing = []
    for param in command.get_params(ctx):
        if not param.required:
            continue
        value, _ = param.consume_value(ctx, opts)
        if param.value_is_missing(value):
            missing.append(param)
    return missing


class ServeCommand(Command):
    """How `bcstack serve X` shows its help: click's plain option list (as every command does,
    `bcstack.cli`), with a narrower option column.

    The help column then holds the longest environment variable (48 characters) on one line at
    80 columns; a long option name gets its help on a line of its own, never cut.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["rich_markup_mode"] = None  # also when mounted alone (python -m services.X)
        super().__init__(*args, **kwargs)

    def format_options(self, ctx: typer.Context, formatter: Any) -> None:
        records = [rv for param in self.get_params(ctx) if (rv := param.get_help_record(ctx)) is not None]
        with formatter.section("Options"):
            formatter.write_dl(records, col_max=OPTION_COLUMN)


def serve_command(
    settings_cls: type[S],
    run: Callable[[S], None],
    *,
    help: str,
    names: Mapping[str, str] | None = None,
    omit: Collection[str] = (),
) -> Callable[..., None]:
    """The `bcstack serve <settings_cls.service_name>` command: options from the settings, then `run`.

    help: the command's help text (first line: the summary `bcstack serve --help` lists).
    names: the option's one name where the whole command line calls the idea something other than
    the setting (`{"records_path": "--records"}`: every command that reads records says `--records`);
    it replaces the setting's name, so one idea never has two options.
    omit: settings this service has no use for (`grpc_port` where it serves no gRPC); no option.
    Secrets get no option either: a command line is visible to every user of the machine (`ps`),
    so they come from the environment or `--config` only; the help names their variables.
    """
    names = dict(names or {})
    fields = settings_cls.model_fields
    unknown = (set(names) | set(omit)) - set(fields)
    if unknown:
        raise ValueError(f"{settings_cls.__name__} has no setting(s) {', '.join(sorted(unknown))}")
    flags = {name for name in names if _strip_optional(fields[name].annotation) is bool}
    if flags:  # a boolean is its --x/--no-x pair (_flag), named after the setting
        listed = ", ".join(sorted(flags))
        raise ValueError(f"{settings_cls.__name__}: no other name for boolean setting(s) {listed}")
    if "config" in fields:
        raise ValueError(f"{settings_cls.__name__}: a setting named 'config' would shadow --config")
    secrets = [name for name in fields if is_secret(settings_cls, name)]
    options = [name for name in fields if name not in secrets and name not in omit]
    json_options = {name for name in options if _takes_json(fields[name])}

    def command(ctx: typer.Context, **values: Any) -> None:
        config = values.pop("config")
        given = {name: value for name, value in values.items() if _typed(ctx, name)}
        for name in json_options & given.keys():
            try:
                given[name] = json.loads(given[name])
            except json.JSONDecodeError as e:
                fail(f"option {names.get(name, '--' + _kebab(name))}: not JSON ({e.msg})")
        run(load_or_fail(settings_cls, config, names, **given))

    config_option = typer.Option(None, "--config", metavar="FILE", help=CONFIG_HELP)
    params = [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        *(_option(settings_cls, name, names.get(name)) for name in options),
        inspect.Parameter(
            "config", inspect.Parameter.KEYWORD_ONLY, default=config_option, annotation=Path | None
        ),
    ]
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__name__ = "serve_" + settings_cls.service_name.replace("-", "_")
    command.__qualname__ = command.__name__
    command.__doc__ = help.strip() + "\n\n" + _precedence_note(settings_cls, secrets)
    return command


def _option(cls: type[ServiceSettings], name: str, option_name: str | None) -> inspect.Parameter:
    info = cls.model_fields[name]
    if _strip_optional(info.annotation) is bool:
        return _flag(cls, name, info)
    decls = [option_name or f"--{_kebab(name)}"]
    default = _default_text(info)
    option = typer.Option(
        # The shown default; never used as a value (a DEFAULT-sourced value is dropped).
        default,
        *decls,
        help=info.description or "",
        metavar=_metavar(info),
        envvar=env_var_name(cls, name),
        show_envvar=True,
        show_default=default is not None,
    )
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=str | None)


def flag_names(name: str) -> tuple[str, str]:
    """A boolean setting's two options: `--log-json/--no-log-json` (`no_search_guard`, already a
    negative, gets `--no-search-guard/--no-search-guard-off`, not `--no-no-search-guard`)."""
    on = f"--{_kebab(name)}"
    return on, (f"{on}-off" if name.startswith("no_") else f"--no-{_kebab(name)}")


def _flag(cls: type[ServiceSettings], name: str, info: FieldInfo) -> inspect.Parameter:
    """A boolean setting as a `--x/--no-x` pair, as every boolean of the `bcstack` CLI is."""
    on, off = flag_names(name)
    default = info.get_default(call_default_factory=True) if not info.is_required() else None
    shown = "" if default is None else f" (default: {'on' if default else 'off'})"
    option = typer.Option(
        None,  # not given: the environment, --config or the setting's default decide
        f"{on}/{off}",
        help=(info.description or "") + shown,
        envvar=env_var_name(cls, name),
        show_envvar=True,
        show_default=False,
    )
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=bool | None)


def _typed(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave option `name` on the command line (not its env var, not the default)."""
    # By name: recent Typer releases vendor click, so their ParameterSource is not click's.
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _precedence_note(cls: type[ServiceSettings], secrets: list[str]) -> str:
    note = (
        "Each setting comes from its option, else its environment variable, else the --config "
        "file, else its default."
    )
    if secrets:
        names = ", ".join(f"{env_var_name(cls, name)} ({name})" for name in secrets)
        note += f"\n\nSecrets have no option, only an environment variable or a --config key: {names}."
    return note


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def _default_text(info: FieldInfo) -> str | None:
    if info.is_required():
        return None
    value = info.get_default(call_default_factory=True)
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        if not value:
            return None
        if all(isinstance(v, str) for v in value):
            return ",".join(value)
        return json.dumps([v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value])
    return str(value)


def _metavar(info: FieldInfo) -> str:
    annotation = _strip_optional(info.annotation)
    if typing.get_origin(annotation) is Literal:
        return "|".join(str(a) for a in typing.get_args(annotation))
    if NoDecode in info.metadata:
        return "A,B,..."
    if _takes_json(info):
        return "JSON"
    names = {bool: "true|false", int: "INTEGER", float: "FLOAT", Path: "PATH", str: "TEXT"}
    return names.get(annotation, "TEXT")  # type: ignore[call-overload]


def _takes_json(info: FieldInfo) -> bool:
    """A list, mapping or model setting: its option value is JSON, as its environment variable is."""
    if NoDecode in info.metadata:
        return False
    annotation = _strip_optional(info.annotation)
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, set, frozenset, dict):
        return True
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _strip_optional(args[0])
    if typing.get_origin(annotation) is typing.Annotated:
        return _strip_optional(typing.get_args(annotation)[0])
    return annotation
