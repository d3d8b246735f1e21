"""docs/tutorials: every command written to work as shown.

- every `bcstack ...` line parses against the real command line (typer/click), options and
  arguments included, without running it;
- every `helm install|upgrade` line renders: its `-f` files and `--set` values merged the way Helm
  merges them (`--set` parsed into the files' values, typed as Helm types them; `--reuse-values`
  on top of the release's previous values), checked against the values schema and the Kubernetes
  schemas;
- the tutorials link to each other and the index lists them all.

The CPU tutorials' `bash tested` blocks are run by the suites with a stack to run them on:
00's by tests/test_eval_stack.py, 01's by tests/test_chart_cpu_preset.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml
from helm_harness import CHART_DIR, render_chart, validate_manifests
from tutorial_util import TUTORIALS, commands, tutorial_files

from bcstack.cli import app

# click's UsageError as Typer carries it (typer._click): what a bad option or argument raises.
UsageError = typer.BadParameter.__bases__[0]

REPO = CHART_DIR.parent.parent
# What a reader replaces before running a command, and what the test puts there.
PLACEHOLDERS = {
    "MODEL_COMMIT_40_HEX": "0123456789abcdef0123456789abcdef01234567",
    "CORPUS_COMMIT_40_HEX": "89abcdef0123456789abcdef0123456789abcdef",
    "$(openssl rand -hex 32)": "0f" * 32,
}


def parse_bcstack(argv: list[str]) -> Any:
    """The click context `bcstack ARGV` would run in: every group resolved down to the command,
    its options and arguments parsed and checked, nothing invoked. (Typer carries its own copy of
    click, typer._click: a group is whatever has `commands`.)"""
    command = typer.main.get_command(app)
    ctx = command.make_context("bcstack", list(argv[1:]))
    while hasattr(ctx.command, "commands"):
        rest = [*ctx._protected_args, *ctx.args]  # noqa: SLF001 - click keeps the subcommand here
        name, sub, rest = ctx.command.resolve_command(ctx, rest)
        assert sub is not None, f"no command {name!r} in {' '.join(argv)}"
        ctx = sub.make_context(name, rest, parent=ctx)
    return ctx


ALL_BCSTACK = [(path.name, argv) for path in tutorial_files() for argv in commands(path)]


@pytest.mark.parametrize(
    ("tutorial", "argv"), ALL_BCSTACK, ids=[f"{t}:{' '.join(a[1:3])}" for t, a in ALL_BCSTACK]
)
def test_every_bcstack_command_parses(
    tutorial: str, argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BCSTACK_EVAL_PASSWORD", "canary")  # 02 exports it before `eval decrypt`
    try:
        parse_bcstack([a.replace("MODEL_COMMIT_40_HEX", PLACEHOLDERS["MODEL_COMMIT_40_HEX"]) for a in argv])
    except UsageError as exc:
        pytest.fail(f"{tutorial}: `{' '.join(argv)}` does not parse: {exc.format_message()}")


# --- helm ------------------------------------------------------------------------------------------


def typed(value: str) -> Any:
    """A `--set` value as Helm types it (strvals.typedVal): true/false/null, an int64 unless it
    starts with 0, else the string."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value.lower() == "null":
        return None
    if value == "0":
        return 0
    if value and value[0] != "0" and re.fullmatch(r"[+-]?\d+", value) and -(2**63) <= int(value) < 2**63:
        return int(value)
    return value


def set_into(values: dict[str, Any], assignment: str, *, as_string: bool = False) -> None:
    """Helm's `--set a.b[0].c=v` parsed into `values` in place (strvals.ParseInto): an index walks
    into the list already there, so the element's other keys stay."""
    key, _, raw = assignment.partition("=")
    value = raw if as_string else typed(raw)
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", key)
    node: Any = values
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        nxt = parts[i + 1] if not last else None
        fresh: Any = [] if nxt is not None and nxt.startswith("[") else {}
        if part.startswith("["):
            index = int(part[1:-1])
            while len(node) <= index:
                node.append(None)
            if last:
                node[index] = value
            else:
                if not isinstance(node[index], (dict, list)):
                    node[index] = fresh
                node = node[index]
        elif last:
            node[part] = value
        else:
            if not isinstance(node.get(part), (dict, list)):
                node[part] = fresh
            node = node[part]


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of -f files: maps deep-merged, anything else replaced."""
    out = dict(base)
    for key, value in override.items():
        out[key] = (
            merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def helm_lines() -> list[tuple[str, list[str]]]:
    return [
        (path.name, argv)
        for path in tutorial_files()
        for argv in commands(path, "helm")
        if len(argv) > 1 and argv[1] in ("install", "upgrade")
    ]


def test_every_helm_install_and_upgrade_renders() -> None:
    lines = helm_lines()
    assert {t for t, _ in lines} >= {
        "01-cpu-preset-on-kind.md",
        "02-one-gpu.md",
        "03-training-on-the-cluster.md",
    }
    previous: dict[str, Any] = {}
    for tutorial, argv in lines:
        for placeholder, value in PLACEHOLDERS.items():
            argv = [a.replace(placeholder, value) for a in argv]
        release, chart, rest = argv[2], argv[3], argv[4:]
        assert (REPO / chart).resolve() == CHART_DIR.resolve(), f"{tutorial}: {chart}"
        values: dict[str, Any] = {}
        namespace = "default"
        i = 0
        while i < len(rest):
            flag = rest[i]
            if flag in ("-f", "--values"):
                values = merged(values, yaml.safe_load((REPO / rest[i + 1]).read_text()))
                i += 2
            elif flag in ("--set", "--set-string"):
                set_into(values, rest[i + 1], as_string=flag == "--set-string")
                i += 2
            elif flag in ("-n", "--k8s-namespace", "--timeout"):
                namespace = rest[i + 1] if flag != "--timeout" else namespace
                i += 2
            elif flag == "--reuse-values":
                assert previous, f"{tutorial}: --reuse-values before any install"
                values = merged(previous, values)
                i += 1
            elif flag in ("--wait", "--atomic"):
                i += 1
            else:
                pytest.fail(f"{tutorial}: `{' '.join(argv)}`: flag {flag} not understood by this test")
        if "--reuse-values" in rest:
            # --set assignments after --reuse-values went into `values` before the merge: redo them
            # on top of the previous values, as Helm applies them last.
            values = dict(previous)
            for j, flag in enumerate(rest):
                if flag in ("--set", "--set-string"):
                    set_into(values, rest[j + 1], as_string=flag == "--set-string")
        try:
            manifests = render_chart(values, release=release, namespace=namespace)
        except Exception as exc:  # noqa: BLE001 - the message is the finding
            pytest.fail(f"{tutorial}: `{' '.join(argv)}` does not render: {exc}")
        validate_manifests(manifests)
        previous = values


def test_set_parses_as_helm_does() -> None:
    values = {"coordinator": {"endpoints": [{"name": "a", "model": "m"}]}}
    set_into(values, "coordinator.endpoints[0].base_url=http://x:1/v1")
    set_into(values, "a.b=1")
    set_into(values, "a.c=010")
    set_into(values, "a.d=null")
    set_into(values, "a.e=2", as_string=True)
    set_into(values, "a.f=")
    assert values["coordinator"]["endpoints"] == [{"name": "a", "model": "m", "base_url": "http://x:1/v1"}]
    assert values["a"] == {"b": 1, "c": "010", "d": None, "e": "2", "f": ""}


def test_the_tutorials_are_listed_and_linked_in_order() -> None:
    files = tutorial_files()
    assert [f.name[:2] for f in files] == ["00", "01", "02", "03", "04"]
    index = (TUTORIALS / "README.md").read_text()
    for i, path in enumerate(files):
        assert f"({path.name})" in index, f"the index does not link {path.name}"
        if i + 1 < len(files):
            assert f"({files[i + 1].name})" in path.read_text(), (
                f"{path.name} does not lead to {files[i + 1].name}"
            )
    for doc in (REPO / "README.md", REPO / "docs" / "cluster.md"):
        assert "docs/tutorials" in doc.read_text() or "tutorials/" in doc.read_text(), doc


def test_the_tested_blocks_are_where_the_suites_run_them() -> None:
    assert commands("00-laptop.md", tested=True) and commands("01-cpu-preset-on-kind.md", tested=True)
    for name in ("02-one-gpu.md", "03-training-on-the-cluster.md", "04-operating.md"):
        assert not commands(name, tested=True), f"{name}: no suite runs a GPU tutorial's commands"
    for runner in ("test_eval_stack.py", "test_chart_cpu_preset.py"):
        assert "tested=True" in (Path(__file__).parent / runner).read_text(), runner
