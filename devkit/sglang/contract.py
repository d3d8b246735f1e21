"""What the stack uses of SGLang, read from our own source, and the check against SGLang's facts.

Uses come from three places, each with its file and line:

- `core/engine_client.py`, the one client of SGLang's API: `ROUTES` (method, path; the
  `ADMIN_ROUTES` carry the admin key) and the `*_FIELDS` name lists (what it sends and reads);
- the CPU engine (`services/engine/service.py` routes, `services/engine/protocol.py` accepted
  request keys), which stands in for SGLang and so may serve and accept only what SGLang does;
- the chart's SGLang command line, rendered (`flag_uses`): every `--flag`, with its value.

`check` answers one line per mismatch, naming our line and SGLang's (the definition that should
hold the name when it is missing), e.g.
`core/engine_client.py:52: UpdateWeightFromDiskReqInput has no field 'flush_cache' in sglang 0.5.19
(sglang/srt/managers/io_struct.py:1776 class UpdateWeightFromDiskReqInput)`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from devkit.sglang.facts import Fact, SGLangFacts
from devkit.sglang.source import REPO

ENGINE_CLIENT = REPO / "core" / "engine_client.py"
ENGINE_SERVICE = REPO / "services" / "engine" / "service.py"
ENGINE_PROTOCOL = REPO / "services" / "engine" / "protocol.py"
WORKER_TEMPLATE = REPO / "charts" / "bcstack" / "templates" / "worker-deployment.yaml"

# engine_client constant -> the kind of SGLang fact each of its names must be.
CLIENT_NAMES = {
    "GENERATE_FIELDS": "GenerateReqInput",
    "SAMPLING_FIELDS": "SamplingParams",
    "RESPONSE_FIELDS": "generate_response",
    "META_INFO_FIELDS": "meta_info",
    "VERSION_SPAN_FIELDS": "meta_info.weight_versions[]",
    "FINISH_REASON_FIELDS": "finish_reason",
    "FINISH_TYPES": "finish_type",
    "UPDATE_WEIGHTS_FIELDS": "UpdateWeightFromDiskReqInput",
    "UPDATE_WEIGHTS_RESPONSE_FIELDS": "update_weights_response",
    "PAUSE_FIELDS": "PauseGenerationReqInput",
    "PAUSE_MODES": "PauseGenerationReqInput.mode",
    "MODEL_INFO_FIELDS": "model_info",
    "ERROR_FIELDS": "error_response",
}
# The CPU engine's request parser: which keys it accepts, as SGLang's structures.
ENGINE_NAMES = {
    "_SUPPORTED_SAMPLING": "SamplingParams",
    "_NEUTRAL_SAMPLING": "SamplingParams",
    "_NEUTRAL_TOP_LEVEL": "GenerateReqInput",
}
_KIND_WORDS = {
    "generate_response": "the /generate answer has no key",
    "meta_info": "meta_info has no key",
    "meta_info.weight_versions[]": "meta_info['weight_versions'] entries have no key",
    "finish_reason": "finish_reason has no key",
    "finish_type": "finish_reason has no type",
    "update_weights_response": "/update_weights_from_disk answers no key",
    "model_info": "/model_info answers no key",
    "error_response": "error answers have no key",
    "route": "there is no route",
    "flag": "there is no server flag",
}
_METHODS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE"}


@dataclass(frozen=True)
class Use:
    """One name the stack relies on, where it relies on it."""

    kind: str
    name: str
    where: str  # "core/engine_client.py:42"
    tags: frozenset[str] = frozenset()  # "admin", "served" (the CPU engine serves it)
    value: str | None = None  # a flag's value on the command line (None: none given)


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO)}:{line}"


def _names(node: ast.AST | None) -> list[ast.Constant]:
    """The string constants a tuple, set, list (or a dict's keys) is made of."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        elts = node.elts
    elif isinstance(node, ast.Dict):
        elts = [k for k in node.keys if k is not None]
    else:
        return []
    return [e for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def _assignments(path: Path) -> dict[str, ast.AST]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[str, ast.AST] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            out[stmt.targets[0].id] = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            out[stmt.target.id] = stmt.value
    return out


def client_uses(path: Path = ENGINE_CLIENT) -> list[Use]:
    values = _assignments(path)
    uses: list[Use] = []
    for constant, kind in CLIENT_NAMES.items():
        for c in _names(values.get(constant)):
            uses.append(Use(kind, c.value, _where(path, c.lineno)))
    admin = {c.value for c in _names(values.get("ADMIN_ROUTES"))}
    routes = values.get("ROUTES")
    if isinstance(routes, ast.Dict):
        for key, value in zip(routes.keys, routes.values, strict=True):
            pair = _names(value)
            if isinstance(key, ast.Constant) and len(pair) == 2:
                tags = frozenset({"admin"}) if key.value in admin else frozenset()
                uses.append(
                    Use("route", f"{pair[0].value} {pair[1].value}", _where(path, value.lineno), tags)
                )
    return uses


def engine_uses(service: Path = ENGINE_SERVICE, protocol: Path = ENGINE_PROTOCOL) -> list[Use]:
    """The CPU engine's routes (`app.get(...)` and friends, as decorators or calls) and the
    request keys its parser accepts."""
    uses: list[Use] = []
    for node in ast.walk(ast.parse(service.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if getattr(node.func.value, "id", "") != "app" or node.func.attr not in _METHODS or not node.args:
            continue
        path = node.args[0]
        if not (isinstance(path, ast.Constant) and isinstance(path.value, str)):
            continue
        deps = next((k.value for k in node.keywords if k.arg == "dependencies"), None)
        tags = {"served"} | ({"admin"} if isinstance(deps, ast.Name) and deps.id == "admin" else set())
        name = f"{_METHODS[node.func.attr]} {path.value}"
        uses.append(Use("route", name, _where(service, node.lineno), frozenset(tags)))
    values = _assignments(protocol)
    for constant, kind in ENGINE_NAMES.items():
        for c in _names(values.get(constant)):
            uses.append(Use(kind, c.value, _where(protocol, c.lineno)))
    return uses


def flag_uses(args: list[str], facts: SGLangFacts, template: Path = WORKER_TEMPLATE) -> list[Use]:
    """The flags of a rendered SGLang command line (`args`), each with its value; a flag SGLang
    knows as a switch takes none. `where` is the template line that writes the flag."""
    lines = template.read_text(encoding="utf-8").splitlines()

    def where(flag: str) -> str:
        line = next((i for i, text in enumerate(lines, 1) if text.strip() in (f"- {flag}", f'- "{flag}"')), 0)
        return _where(template, line) if line else f"{template.relative_to(REPO)} (extraArgs)"

    uses, i = [], 0
    while i < len(args):
        flag, value = args[i], None
        if not flag.startswith("--"):
            i += 1
            continue
        if "=" in flag:
            flag, value = flag.split("=", 1)
        else:
            known = facts.of("flag").get(flag)
            takes_value = known is None or "switch" not in known.tags
            if takes_value and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
        uses.append(Use("flag", flag, where(flag), value=value))
        i += 1
    return uses


def _missing(use: Use, facts: SGLangFacts) -> str:
    words = _KIND_WORDS.get(use.kind, f"{use.kind} has no field")
    return f"{use.where}: {words} {use.name!r} in sglang {facts.version} ({facts.anchor(use.kind)})"


def _check_one(use: Use, facts: SGLangFacts, pinned: SGLangFacts | None) -> str | None:
    v = facts.version
    if use.kind.endswith(".mode"):  # a Literal field's value
        cls, _, field_name = use.kind.rpartition(".")
        fact = facts.of(cls).get(field_name)
        if fact is None:
            return _missing(Use(cls, field_name, use.where), facts)
        if use.name not in fact.choices:
            at = f"in sglang {v} ({fact.where}: {list(fact.choices)})"
            return f"{use.where}: {cls}.{field_name} takes no {use.name!r} {at}"
        return None
    fact: Fact | None = facts.of(use.kind).get(use.name)
    if fact is None:
        # The CPU engine mirrors the pinned version: a deprecated stub there may be gone in a newer one.
        stub = pinned.of(use.kind).get(use.name) if pinned is not None else None
        if "served" in use.tags and stub is not None and "deprecated-stub" in stub.tags:
            return None
        return _missing(use, facts)
    if use.kind == "route":
        return _check_route(use, fact, v)
    if use.kind == "flag":
        return _check_flag(use, fact, v)
    return None


def _check_route(use: Use, fact: Fact, version: str) -> str | None:
    deprecated = fact.tags & {"deprecated-stub", "deprecated-alias"}
    if deprecated and "served" not in use.tags:
        how = "answers 404 (a deprecated stub)" if "deprecated-stub" in fact.tags else "is a deprecated alias"
        return f"{use.where}: {use.name} {how} in sglang {version} ({fact.where} {fact.handler}())"
    if ("admin" in use.tags) != ("admin" in fact.tags):
        ours = "takes the admin key" if "admin" in use.tags else "does not take the admin key"
        theirs = "an admin route" if "admin" in fact.tags else "not an admin route"
        return f"{use.where}: {use.name} {ours}, but is {theirs} in sglang {version} ({fact.where})"
    return None


def _check_flag(use: Use, fact: Fact, version: str) -> str | None:
    switch = "switch" in fact.tags
    at = f"in sglang {version} ({fact.where})"
    if switch and use.value is not None:
        return f"{use.where}: {use.name} is a switch but is given {use.value!r} {at}"
    if not switch and use.value is None:
        return f"{use.where}: {use.name} needs a value {at}"
    if fact.choices and use.value is not None and use.value not in fact.choices:
        return f"{use.where}: {use.name} {use.value!r} is not one of {list(fact.choices)} {at}"
    return None


def check(facts: SGLangFacts, uses: Iterable[Use], pinned: SGLangFacts | None = None) -> list[str]:
    """One line per use that SGLang `facts.version` does not hold as we use it. `pinned`: the
    pinned version's facts, whose deprecated stubs the CPU engine serves whatever the target."""
    return [problem for use in uses if (problem := _check_one(use, facts, pinned)) is not None]
