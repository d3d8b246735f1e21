"""One settings object per service, on pydantic-settings.

Precedence, highest first: explicit overrides (the `bcstack serve` command-line options) >
environment variables `BCSTACK_<SERVICE>_<SETTING>` > the YAML file given with `--config` >
the defaults declared on the class. A service declares its own settings by subclassing:

    class RetrievalSettings(ServiceSettings):
        service_name: ClassVar[str] = "retrieval"      # env prefix BCSTACK_RETRIEVAL_
        port: int = 8001
        index_dir: Path | None = Field(None, description="index directory from `bcstack index`")

    settings = load_settings(RetrievalSettings, config_file=args.config, port=args.port)

The admin token is shared by every service and comes from `BCSTACK_ADMIN_TOKEN` (no service
prefix). It is a `SecretStr`: repr, str and JSON dumps show `**********`, and its value is
registered with the log redaction filter as soon as a settings object holds it.
"""

from __future__ import annotations

import contextvars
import os
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import AliasChoices, BeforeValidator, Field, SecretStr, ValidationError
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from core.kit.logging import register_secret

ADMIN_TOKEN_ENV = "BCSTACK_ADMIN_TOKEN"
MiB = 1024 * 1024


def _blank_secret_is_unset(value: Any) -> Any:
    # Secrets read from mounted files often end in a newline; a blank one means "not set".
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, str):
        return value.strip() or None
    return value


# A secret setting: SecretStr (never printed), surrounding blanks stripped, blank = unset.
OptionalSecret = typing.Annotated[SecretStr | None, BeforeValidator(_blank_secret_is_unset)]

LogLevel = typing.Annotated[
    Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
    BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v),
]

S = TypeVar("S", bound="ServiceSettings")

# The parsed --config file of the load_settings call in progress. Settings sources are built
# inside BaseSettings.__init__, so the YAML values reach them through this variable rather
# than through a class attribute that concurrent loads would share.
_yaml_values: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "bcstack_yaml_values", default=None
)


class SettingsError(ValueError):
    """A settings source is unusable; `str(exc)` is one line naming the file or variable."""


def env_prefix_for(service_name: str) -> str:
    """`coordinator-llm` -> `BCSTACK_COORDINATOR_LLM_`."""
    return "BCSTACK_" + service_name.upper().replace("-", "_").replace(".", "_") + "_"


class ServiceSettings(BaseSettings):
    """Settings every service has. Subclasses set `service_name` and add their own fields."""

    service_name: ClassVar[str] = "service"

    model_config = SettingsConfigDict(
        env_prefix=env_prefix_for("service"),
        env_nested_delimiter="__",
        # An empty variable (a common Helm/compose leftover) means "not set", not "".
        env_ignore_empty=True,
        extra="forbid",
        validate_by_name=True,
        validate_default=True,
    )

    host: str = Field("127.0.0.1", description="address to bind (HTTP and gRPC)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = any free port)")
    grpc_port: int | None = Field(
        None, ge=0, le=65535, description="gRPC port; unset = no gRPC server (0 = any free port)"
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="separate Prometheus /metrics port for a process without an HTTP app",
    )
    log_level: LogLevel = Field("INFO", description="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    log_json: bool = Field(False, description="log one JSON object per line")
    admin_token: OptionalSecret = Field(
        None,
        # An alias is not prefixed: the one token serves every service. validate_by_name keeps
        # `admin_token` usable as an override or YAML key.
        validation_alias=ADMIN_TOKEN_ENV,
        description="Bearer token for admin endpoints; unset = admin endpoints disabled",
    )
    max_request_bytes: int = Field(16 * MiB, ge=0, description="largest HTTP request body (413 above)")
    grpc_max_message_bytes: int = Field(64 * MiB, gt=0, description="largest gRPC message, both ways")
    # uvicorn's default of 5 s races clients and proxies that keep connections longer (httpx: 5 s,
    # ingress-nginx: 60 s) and, under load, its own event loop: the server closes a connection
    # whose next request is already in flight and the client gets a ReadError. bench/gateway.py
    # saw that at 512 concurrent episodes; vLLM and KServe made it configurable for the same reason.
    http_keep_alive_seconds: float = Field(
        75.0, gt=0, description="idle time before the HTTP server closes a kept-alive connection"
    )
    shutdown_grace_seconds: float = Field(
        10.0, ge=0, description="time in-flight requests get to finish on SIGTERM/SIGINT"
    )

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        # The env prefix always follows service_name, so the two cannot drift apart.
        # pydantic-settings reads model_config when an instance is built, not at class creation.
        cls.model_config["env_prefix"] = env_prefix_for(cls.service_name)

    def model_post_init(self, context: Any, /) -> None:
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                register_secret(value)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_values = _yaml_values.get() or {}
        return (
            init_settings,
            env_settings,
            _StackWideEnv(settings_cls),
            InitSettingsSource(settings_cls, init_kwargs=yaml_values),
        )


# Settings every process of a deployment shares (the chart's common ConfigMap sets them once).
# A service's own BCSTACK_<SERVICE>_LOG_LEVEL still wins over BCSTACK_LOG_LEVEL.
STACK_WIDE_ENV = {"log_level": "BCSTACK_LOG_LEVEL", "log_json": "BCSTACK_LOG_FORMAT"}


class _StackWideEnv(PydanticBaseSettingsSource):
    def get_field_value(
        self, field: Any, field_name: str
    ) -> tuple[Any, str, bool]:  # pragma: no cover - unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        level = os.environ.get(STACK_WIDE_ENV["log_level"], "").strip()
        if level:
            values["log_level"] = level
        fmt = os.environ.get(STACK_WIDE_ENV["log_json"], "").strip().lower()
        if fmt:
            # BCSTACK_LOG_FORMAT is "json" or "text"; anything else is passed on to fail validation.
            values["log_json"] = {"json": True, "text": False}.get(fmt, fmt)
        return values


def env_var_name(cls: type[ServiceSettings], field: str) -> str:
    """The environment variable that sets `field` (upper-case, as documented)."""
    info = cls.model_fields[field]
    alias = info.validation_alias
    if isinstance(alias, AliasChoices):
        env_names = [c for c in alias.choices if isinstance(c, str) and c.isupper()]
        if env_names:
            return env_names[0]
    elif isinstance(alias, str):
        return alias.upper()
    return (cls.model_config.get("env_prefix", "") + field).upper()


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML settings file into a mapping; SettingsError on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"config file {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SettingsError(f"config file {path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(
            f"config file {path}: expected a mapping of setting names to values, got {type(data).__name__}"
        )
    return {str(k): v for k, v in data.items()}


def load_settings(cls: type[S], config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> S:
    """Build `cls` from overrides > env > YAML `config_file` > defaults.

    Overrides whose value is None are ignored, so unset command-line options can be passed
    straight through. Raises SettingsError with a one-line message naming the offending
    file key, environment variable or option.
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    unknown = unknown_env_settings(cls)
    if unknown:
        raise SettingsError(f"{cls.__name__}: " + "; ".join(unknown))
    yaml_values = read_config_file(config_file) if config_file is not None else {}
    token = _yaml_values.set(yaml_values)
    try:
        return cls(**overrides)
    except ValidationError as exc:
        raise SettingsError(_explain(cls, exc, overrides, yaml_values, config_file)) from None
    finally:
        _yaml_values.reset(token)


# Every service's env prefix; a longer one is not a typo of a shorter one
# (BCSTACK_COORDINATOR_LLM_PORT is coordinator-llm's, not an unknown coordinator setting).
SERVICE_NAMES = (
    "retrieval",
    "worker",
    "engine",
    "coordinator",
    "coordinator-llm",
    "judge",
    "trainer",
    "eval",
    "up",
)


def unknown_env_settings(
    cls: type[ServiceSettings], environ: typing.Mapping[str, str] | None = None
) -> list[str]:
    """One message per `BCSTACK_<SERVICE>_*` variable that names no setting of `cls`.

    pydantic-settings reads only the variables of known fields, so a misspelt one would be
    silently ignored and the default used: a deployment that looks configured and is not.
    """
    import difflib

    environ = os.environ if environ is None else environ
    prefix = env_prefix_for(cls.service_name)
    others = [env_prefix_for(n) for n in SERVICE_NAMES if len(env_prefix_for(n)) > len(prefix)]
    names = {name.upper() for name in cls.model_fields}
    messages = []
    for var in sorted(environ):
        if not var.startswith(prefix) or any(var.startswith(o) for o in others):
            continue
        setting = var[len(prefix) :].split("__", 1)[0]  # NAME__SUB sets a nested field of NAME
        if setting in names:
            continue
        close = difflib.get_close_matches(setting, sorted(names), n=1)
        hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        messages.append(f"environment variable {var} is not a setting of {cls.service_name}{hint}")
    return messages


def _explain(
    cls: type[ServiceSettings],
    exc: ValidationError,
    overrides: dict[str, Any],
    yaml_values: dict[str, Any],
    config_file: str | os.PathLike[str] | None,
) -> str:
    problems = []
    for err in exc.errors(include_url=False):
        loc = err.get("loc") or ("?",)
        key = str(loc[0])
        field = _field_for_key(cls, key)
        dotted = ".".join(str(p) for p in loc)
        if err.get("type") == "extra_forbidden":
            where = f"config file {config_file}" if key in yaml_values else "options"
            problems.append(f"{where}: unknown setting {key!r}")
            continue
        secret = field is not None and is_secret(cls, field)
        if key in overrides or (field is not None and field in overrides):
            where = f"option --{(field or key).replace('_', '-')}"
        elif field is not None and _env_source(cls, field) is not None:
            where = f"environment variable {_env_source(cls, field)}"
        elif config_file is not None and (key in yaml_values or field in yaml_values):
            where = f"config file {config_file}: key {dotted!r}"
        else:
            where = f"setting {dotted!r}"
        got = ""
        if not secret and "input" in err and not isinstance(err["input"], dict):
            got = f" (got {_short(err['input'])})"
        problems.append(f"invalid {where}: {err['msg']}{got}")
    return f"{cls.__name__}: " + "; ".join(problems)


def _field_for_key(cls: type[ServiceSettings], key: str) -> str | None:
    if key in cls.model_fields:
        return key
    for name, info in cls.model_fields.items():
        alias = info.validation_alias
        choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
        if any(isinstance(c, str) and c.lower() == key.lower() for c in choices):
            return name
    return None


def _env_source(cls: type[ServiceSettings], field: str) -> str | None:
    """The environment variable that supplied `field`, if any (case-insensitive, as pydantic-settings)."""
    wanted = env_var_name(cls, field).lower()
    nested = wanted + cls.model_config.get("env_nested_delimiter", "__")
    for name in os.environ:
        low = name.lower()
        if low == wanted or low.startswith(nested):
            return name
    return None


def is_secret(cls: type[ServiceSettings], field: str) -> bool:
    """Whether `field` holds a secret (a SecretStr): never printed, never a command-line option."""
    return _mentions(cls.model_fields[field].annotation, SecretStr)


def _mentions(annotation: Any, target: type) -> bool:
    if annotation is target:
        return True
    return any(_mentions(arg, target) for arg in typing.get_args(annotation))


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
