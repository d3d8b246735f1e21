"""The command line: README commands exist, help is fast and complete, the demo is honest."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bcstack(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bcstack", *args], capture_output=True, text=True, cwd=ROOT)


def _in_process(*args: str) -> subprocess.CompletedProcess:
    """`bcstack ARGS` through Typer's CliRunner, as a subprocess would print it where stdout is no
    terminal: 80 columns (Click wraps its plain help at the width less 2, Rich at 80). A --help or an
    argument error needs no process of its own: this saves ~1 s of imports per call."""
    from typer.testing import CliRunner

    from bcstack.cli import app

    result = CliRunner().invoke(
        app, list(args), prog_name="python -m bcstack", terminal_width=78, env={"COLUMNS": "80"}
    )
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def _readme_commands() -> list[list[str]]:
    """Every `bcstack <group> <command>` the README and the docs pages show (once each)."""
    found: list[list[str]] = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for line in page.read_text().splitlines():
            m = re.match(r"^bcstack ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", line.strip())
            if m and (words := [w for w in m.groups() if w]) not in found:
                found.append(words)
    return found


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    head = text[: text.index("## ")]
    assert "make demo" in head and "make test" in head
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")


@pytest.mark.parametrize("command", _readme_commands(), ids=" ".join)
def test_every_readme_command_exists(command):
    result = _in_process(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout


def test_root_help_lists_the_groups_and_the_readme_lists_them_back():
    result = _in_process("--help")
    assert result.returncode == 0
    groups = {c[0] for c in _readme_commands()}
    for group in groups:
        assert group in result.stdout
    assert groups >= {"toyworld", "model"}


def test_help_does_not_import_torch():
    code = "import sys; from bcstack.cli import app; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def _every_command() -> list[tuple[list[str], object]]:
    """(path, click command) for `bcstack` and every group and command under it."""
    import typer

    from bcstack.cli import app

    found = []

    def walk(command: object, path: list[str]) -> None:
        found.append((path, command))
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


def test_every_help_fits_80_columns_with_every_option_name_whole():
    """One help renderer (click's plain list, no Rich boxes), legible at 80 columns: no line wider,
    no name cut with an ellipsis, every option's names (both of a --x/--no-x pair) there whole."""
    for path, command in _every_command():
        result = _in_process(*path, "--help")
        where = f"bcstack {' '.join(path)} --help"
        assert result.returncode == 0, f"{where}: {result.stderr}"
        text = result.stdout
        assert "…" not in text and "╭" not in text and "│" not in text, f"{where}: a Rich table"
        wide = [line for line in text.splitlines() if len(line) > 80]
        assert not wide, f"{where}: lines over 80 columns: {wide}"
        for param in command.params:
            for name in [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]:
                if name.startswith("-"):
                    assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{where}: {name} cut"


def test_every_boolean_option_is_an_x_no_x_pair():
    """`--force/--no-force`, `--log-json/--no-log-json`: no bare flag, no boolean that takes a value."""
    bare = []
    for path, command in _every_command():
        for param in command.params:
            opts = getattr(param, "opts", [])
            flag = getattr(param, "is_flag", False) and not set(opts) & {"--help", "--version"}
            if flag and not getattr(param, "secondary_opts", []):
                bare.append(f"bcstack {' '.join(path)} {opts[0]}")
    assert bare == []


def test_every_option_has_one_name():
    """One name per idea: no option answers to two long names (`--records-path, --records`)."""
    doubled = []
    for path, command in _every_command():
        for param in command.params:
            for names in (getattr(param, "opts", []), getattr(param, "secondary_opts", [])):
                if len([n for n in names if n.startswith("--")]) > 1:
                    doubled.append(f"bcstack {' '.join(path)} {', '.join(names)}")
    assert doubled == []


def test_a_missing_arguments_error_names_every_missing_one():
    result = _in_process("train", "rl")
    assert result.returncode == 2
    assert "Missing options '--questions', '--model', '--ref' and '--out'." in result.stderr
    result = _in_process("train", "rl", "--model", "m")
    assert "Missing options '--questions', '--ref' and '--out'." in result.stderr
    result = _in_process("train", "merge-lora", "--base", "b", "--out", "o")  # one: click's own message
    assert "Missing option '--adapter'." in result.stderr
    # An argument and an option: each kind named once.
    import typer
    from typer.testing import CliRunner

    from core.kit.cli import Command

    app = typer.Typer(rich_markup_mode=None)

    @app.command(cls=Command)
    def show(path: str = typer.Argument(...), out: str = typer.Option(..., "--out")) -> None:
        pass

    result = CliRunner().invoke(app, [])
    assert "Missing argument 'path' and option '--out'." in result.stderr


def test_train_commands_refuse_a_bad_path_before_importing_torch(tmp_path: Path):
    """A mistyped path is refused in one line before torch's import (seconds): every train command."""
    nope = str(tmp_path / "nope")
    cases = [
        (["train", "sft", "--model", nope, "--source", nope, "--out", nope], "--model"),
        (["train", "grpo", "--model", nope, "--records", nope, "--ref", nope, "--out", nope],
         "no episode records"),
        (["train", "grpo", "--env", "arithmetic", "--model", nope, "--engine", "http://h:1",
          "--prompts", nope, "--out", nope], "--model"),
        (["train", "rl", "--questions", nope, "--model", nope, "--ref", nope, "--out", nope], "--questions"),
        (["train", "export", "--model", nope, "--out", nope], "--model"),
        (["train", "merge-lora", "--base", nope, "--adapter", nope, "--out", nope], "--base"),
        (["train", "distill", "--teachers", nope, "--model", nope, "--engine", "http://h:1",
          "--prompts", nope, "--out", nope], "--teachers"),
        (["train", "gate-rows", "--records", nope, "--tokenizer", nope, "--out", nope], "--records"),
    ]  # fmt: skip
    code = (
        "import json, sys\n"
        "from typer.testing import CliRunner\n"
        "from bcstack.cli import app\n"
        "for args in json.loads(sys.argv[1]):\n"
        "    r = CliRunner().invoke(app, args)\n"
        "    print(json.dumps([r.exit_code, r.stderr.strip(), 'torch' in sys.modules]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps([a for a, _ in cases])],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    for (args, says), line in zip(cases, run.stdout.splitlines(), strict=True):
        code_, stderr, torch_loaded = json.loads(line)
        assert (code_, torch_loaded) == (2, False), f"{args}: {stderr}"
        assert stderr.startswith("error: ") and says in stderr and "\n" not in stderr, f"{args}: {stderr}"


def test_unknown_command_is_a_clear_error():
    result = _in_process("frobnicate")
    assert result.returncode != 0 and "Traceback" not in result.stderr


@pytest.mark.parametrize("trainer", ["grpo", "sft", "rl"])
def test_a_tp_size_the_job_cannot_hold_is_one_error_line(tmp_path: Path, trainer: str):
    # One process cannot be two tensor-parallel ranks: refused before anything is loaded, and before
    # torch is imported (trainer.layout), so the line comes in half a second, not six.
    out = tmp_path / "run"
    for name in ("records.jsonl", "questions.jsonl"):
        (tmp_path / name).touch()
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")  # the paths pass the cheap checks
    model = ["--model", str(tmp_path / "m"), "--out", str(out), "--tp", "2"]
    args = {
        "grpo": ["--records", str(tmp_path / "records.jsonl"), "--ref", str(tmp_path / "m")],
        "sft": ["--source", f"chat={tmp_path / 'chat.jsonl'}"],
        "rl": ["--judge", "http://127.0.0.1:1", "--questions", str(tmp_path / "questions.jsonl"),
               "--ref", str(tmp_path / "m")],
    }[trainer]  # fmt: skip
    command = [sys.executable, "-X", "importtime", "-m", "bcstack", "train", trainer, *args, *model]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    ]
    said = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert said == [
        "error: --tp 2 does not divide the job's 1 processes (torchrun --nproc_per_node x --nnodes)"
    ]
    assert "torch" not in imported and "transformers" not in imported
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "error: nothing to check: give --gateway, --metrics NAME=URL or --state DIR"),
        (["--metrics", "judge"], "error: --metrics 'judge': give NAME=http://HOST:PORT"),
        (
            ["--metrics", "grader=http://h:1"],
            "error: --metrics 'grader=http://h:1': unknown service 'grader'",
        ),
        (["--state", "no-such-state"], "error: no running stack described at no-such-state/stack.json"),
    ],
)
def test_smoke_refuses_what_it_cannot_check_in_one_line(args, says, tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "bcstack", "smoke", *args], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(says), line


def test_smoke_fails_with_exit_1_when_a_service_is_down(free_port):
    result = _bcstack("smoke", "--metrics", f"judge=http://127.0.0.1:{free_port}", "--timeout", "5")
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines()[0].startswith("FAIL  judge /metrics")
    assert result.stdout.splitlines()[-1] == "smoke: 0/1 checks passed"


def test_demo_help_says_what_it_does():
    # The demo itself (about 4 minutes) runs in `make demo`; its parts are tested in test_eval_stack.py.
    result = subprocess.run(
        [sys.executable, "-m", "bcstack.demo", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0
    assert (
        "150 test" in result.stdout and "--sample-per-tier" in result.stdout and "tiny model" in result.stdout
    )


def _serve_settings() -> dict[str, type]:
    from services.coordinator.settings import CoordinatorSettings
    from services.coordinator_llm.settings import CoordinatorLlmSettings
    from services.engine.settings import EngineSettings
    from services.judge.settings import JudgeSettings
    from services.retrieval.settings import RetrievalSettings
    from services.worker.settings import WorkerSettings

    classes = (
        RetrievalSettings, WorkerSettings, EngineSettings, CoordinatorSettings, CoordinatorLlmSettings,
        JudgeSettings,
    )  # fmt: skip
    return {cls.service_name: cls for cls in classes}


# Settings whose option is named as the rest of the CLI names the idea, not after the setting:
# one name each (every command that reads records says --records), never a second one.
RENAMED_OPTIONS = {
    "coordinator": ("--records", "records_path"),
}


def _help_entries(text: str) -> dict[str, str | None]:
    """`--help` parsed: each option name -> the env var its entry names (None when it names none)."""
    entries: dict[str, str | None] = {}
    blocks = re.split(r"^  (?=-)", text.split("\nOptions:\n", 1)[1], flags=re.MULTILINE)
    for block in blocks[1:]:
        names = re.findall(r"--[a-z0-9-]+", block.split("  ", 1)[0])
        env = re.search(r"\[env\s+var:\s+(BCSTACK_[A-Z0-9_]+)", block)
        for name in names:
            entries[name] = env.group(1) if env else None
    return entries


@pytest.mark.parametrize("service", sorted(_serve_settings()))
def test_serve_help_lists_every_setting_with_its_env_var(service):
    """DESIGN.md §8: `bcstack serve X --help` lists its settings and env vars; --grpc-port where gRPC is
    served. One option per setting, named after it, showing its variable; secrets only by variable."""
    from core.kit.cli import flag_names
    from core.kit.settings import env_var_name, is_secret

    cls = _serve_settings()[service]
    result = _in_process("serve", service, "--help")  # not a terminal: 80 columns
    assert result.returncode == 0, result.stderr
    entries = _help_entries(result.stdout)
    secrets = {name for name in cls.model_fields if is_secret(cls, name)}
    unused = {"metrics_port"} | ({"grpc_port"} if service in ("engine", "coordinator-llm") else set())
    expected = {
        "--" + name.replace("_", "-"): env_var_name(cls, name)
        for name in cls.model_fields
        if name not in secrets | unused
    }
    for name in list(expected):
        field = name[2:].replace("-", "_")
        if field in cls.model_fields and cls.model_fields[field].annotation is bool:
            expected[flag_names(field)[1]] = expected[name]  # --x/--no-x, as every boolean
    if service in RENAMED_OPTIONS:
        option, field = RENAMED_OPTIONS[service]
        expected[option] = expected.pop("--" + field.replace("_", "-"))
    assert entries == {**expected, "--config": None, "--help": None}
    assert {"--host", "--port"} <= entries.keys()
    for name in secrets:
        assert env_var_name(cls, name) in result.stdout.split()  # whole, not cut at the edge
