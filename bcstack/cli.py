"""The one `bcstack` entry point (DESIGN.md §8).

Each command group lives beside the code it drives and is only imported here; heavy imports
(torch, transformers, grpc) stay inside the commands so that `bcstack --help` is instant.
"""

from __future__ import annotations

from pathlib import Path

import typer
from typer.core import TyperCommand

from bcstack import __version__, corpus, episodes_cli, fetch, reload_cli
from bcstack import coordinator_cli as coordinator_ops
from bcstack.evaluation.cli import app as eval_app
from bcstack.rl import cli as rl_cli
from bcstack.rl import report as rl_report
from core.kit.cli import Command, ServeCommand
from devkit.modelkit.cli import app as model_app
from devkit.toyworld.cli import app as toyworld_app
from services.coordinator import cli as coordinator_cli
from services.coordinator_llm import cli as coordinator_llm_cli
from services.engine import cli as engine_cli
from services.judge import cli as judge_cli
from services.retrieval import cli as retrieval_cli
from services.retrieval.loadtest_cli import app as loadtest_app
from services.worker import cli as worker_cli
from trainer import cli as trainer_cli
from trainer import sft_cli

app = typer.Typer(
    name="bcstack",
    help=(
        "browsecomp-stack: deploy, evaluate and train BrowseComp research workers "
        "(Qwen3-4B under a frozen coordinator LLM). On a machine with no GPU every command "
        "runs on embedded defaults: a toy world, a tiny Qwen3 model on the CPU, in-process indexes."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # One help renderer for every command: click's plain option list, never Rich's table (which
    # cuts long option names with an ellipsis at 80 columns). The root's mode is every subcommand's.
    rich_markup_mode=None,
)
serve_app = typer.Typer(
    help="Start one service of the stack (each has --help with its settings).", no_args_is_help=True
)
serve_app.command("retrieval", cls=ServeCommand)(retrieval_cli.serve)
serve_app.command("worker", cls=ServeCommand)(worker_cli.serve)
serve_app.command("engine", cls=ServeCommand)(engine_cli.serve)
serve_app.command("coordinator", cls=ServeCommand)(coordinator_cli.serve)
serve_app.command("coordinator-llm", cls=ServeCommand)(coordinator_llm_cli.serve)
serve_app.command("judge", cls=ServeCommand)(judge_cli.serve)

app.add_typer(toyworld_app, name="toyworld")
app.add_typer(model_app, name="model")
app.command("index")(retrieval_cli.index)
app.add_typer(serve_app, name="serve")
app.command("search")(retrieval_cli.search)
app.add_typer(loadtest_app, name="loadtest")
app.add_typer(eval_app, name="eval")
train_app = typer.Typer(
    help="The trainer: SFT, GRPO (episode records, or single-turn domains with LoRA), the RL loop, "
    "serving-format export, LoRA merge, multi-teacher on-policy distillation.",
    no_args_is_help=True,
)
train_app.command("sft")(sft_cli.sft)
train_app.command("gate-rows")(sft_cli.gate_rows)
train_app.command("grpo")(trainer_cli.grpo)
train_app.command("rl")(rl_cli.rl)
train_app.command("report")(rl_report.report)
train_app.command("export")(trainer_cli.export)
train_app.command("merge-lora")(trainer_cli.merge_lora_command)
train_app.command("distill")(trainer_cli.distill)
app.add_typer(train_app, name="train")
checkpoint_app = typer.Typer(help="Serving-format checkpoints.", no_args_is_help=True)
checkpoint_app.command("verify")(trainer_cli.verify)
checkpoint_app.command("fetch")(fetch.command)
app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(corpus.app, name="corpus")
app.add_typer(reload_cli.app, name="worker", help="Operate running workers: rolling and canary hot reloads.")
app.add_typer(
    coordinator_ops.app,
    name="coordinator",
    help="Operate running coordinator gateways: swap the endpoint of every replica.",
)
app.add_typer(
    episodes_cli.app,
    name="episodes",
    help="Read recorded episodes: `show ID` prints one, as the gateway's /ui shows it.",
)


@app.command("up")
def up(
    worker: str = typer.Option(
        "expert",
        "--worker",
        help="What the worker runs: expert (the scripted expert policy), expert-snippets (the expert "
        "reading facts off search snippets), tiny (the untrained tiny model) or a model folder.",
    ),
    state: Path = typer.Option(
        Path(".bcstack"), "--state", help="Where the stack keeps its files and stack.json."
    ),
    docs: int = typer.Option(2000, "--docs", help="Toy world size, when the world has to be built."),
    seed: int = typer.Option(0, "--seed", help="Toy world and tiny model seed, when they have to be built."),
    questions_per_tier: int = typer.Option(
        50, "--questions-per-tier", help="Toy test questions per tier, when the world has to be built."
    ),
    world: Path = typer.Option(
        None,
        "--world",
        metavar="DIR",
        help="An existing toy world (corpus.jsonl, questions.jsonl), used as it is; default: STATE/world.",
    ),
    kit: Path = typer.Option(
        None,
        "--kit",
        metavar="DIR",
        help="An existing tiny kit (config.json and tokenizer): the worker's tokenizer and, with --worker "
        "tiny, the model; used as it is; default: STATE/tiny.",
    ),
    index: Path = typer.Option(
        None,
        "--index-dir",
        metavar="DIR",
        help="An existing complete retrieval index (`bcstack index`), used as it is; default: STATE/index.",
    ),
    dense: str = typer.Option(
        None,
        "--dense",
        metavar="edge|none",
        help="Dense backend of an index built here (`bcstack index --dense`); none: lexical only, "
        "much faster to build. Default: edge.",
    ),
    worker_setting: list[str] = typer.Option(
        [],
        "--worker-setting",
        metavar="KEY=VALUE",
        help="A worker setting (`bcstack serve worker --help`), e.g. snippet_words=24; repeatable.",
    ),
    engine_setting: list[str] = typer.Option(
        [],
        "--engine-setting",
        metavar="KEY=VALUE",
        help="An engine setting (`bcstack serve engine --help`), e.g. max_running_requests=4; repeatable.",
    ),
    records: Path = typer.Option(
        None,
        "--records",
        metavar="FILE",
        help="The gateway's episode record file (--records-backend sqlite); default: STATE/records.sqlite.",
    ),
    records_backend: str = typer.Option(
        "sqlite",
        "--records-backend",
        metavar="sqlite|postgres",
        help="Where the gateways keep their episode records: sqlite (one file, one gateway) or postgres "
        "(a PostgreSQL server of the stack's own in STATE/postgres, kept across down and up; its "
        "programs come with Debian's postgresql package, `make install-test` adds it).",
    ),
    replicas: int = typer.Option(
        1,
        "--replicas",
        min=1,
        help="Worker replicas, each an engine and a worker sidecar (engine-2/worker-2, ... in stack.json); "
        "the gateway sends each episode to the least busy. The CPU engine runs on one core: on a machine "
        "with N cores, N replicas generate up to N times as fast.",
    ),
    gateways: int = typer.Option(
        1,
        "--gateways",
        min=1,
        help="Coordinator gateway replicas on one PostgreSQL (needs --records-backend postgres; "
        "coordinator-2, ... in stack.json), behind one HAProxy front that balances across them as a "
        "Kubernetes Service does: the front's URL is the stack's gateway URL.",
    ),
) -> None:
    """Start the whole stack on embedded defaults as local processes; build what is missing first.

    Retrieval, the engine, the worker, the scripted coordinator LLM, the coordinator gateway and
    the judge (rule) start on loopback ports (the default ports when free); their URLs and pids go
    to STATE/stack.json, their logs to STATE/logs/. With --records-backend postgres a PostgreSQL
    server starts first in STATE/postgres; --gateways N runs N gateways on it behind one HAProxy.
    Stop them with `bcstack down`. A --world, --kit or --index-dir given is used as it is instead of
    building one under STATE; the
    --worker-setting / --engine-setting values are checked against those services' settings
    before anything starts and reach them as their `bcstack serve` options.
    """
    from bcstack.stack import StackError, gateway_url, parse_settings
    from bcstack.stack import up as stack_up
    from core.kit.cli import fail

    try:
        info = stack_up(
            state,
            worker=worker,
            docs=docs,
            seed=seed,
            questions_per_tier=questions_per_tier,
            world=world,
            kit=kit,
            index=index,
            dense=dense,
            worker_settings=parse_settings("--worker-setting", worker_setting),
            engine_settings=parse_settings("--engine-setting", engine_setting),
            records=records,
            replicas=replicas,
            records_backend=records_backend,
            gateways=gateways,
        )
    except StackError as e:
        fail(str(e))
    gateway = gateway_url(info)
    typer.echo(
        f"stack up ({worker} worker); state in {state}/stack.json, logs in {state}/logs, admin token in "
        f"{info['admin_token_file']}\n"
        f"  gateway: {gateway}"
        + (f" (HAProxy over {gateways} gateways)" if gateways > 1 else "")
        + f"; records: {info['assets']['records']}\n"
        f"  try: curl -s {gateway}/v1/episodes -H 'content-type: application/json' "
        f'-d \'{{"question": "..."}}\'\n'
        f"  metrics: {gateway}/metrics (every service has /metrics)\n"
        f"  stop: bcstack down --state {state}"
    )


@app.command("down")
def down(
    state: Path = typer.Option(Path(".bcstack"), "--state", help="The state folder `bcstack up` used."),
) -> None:
    """Stop every process of the stack started by `bcstack up` (SIGTERM, then SIGKILL after 20 s)."""
    from bcstack.stack import StackError
    from bcstack.stack import down as stack_down
    from core.kit.cli import fail

    try:
        n = stack_down(state)
    except StackError as e:
        fail(str(e))
    typer.echo(f"stack down: {n} service(s) stopped")


@app.command("restart")
def restart(
    name: str = typer.Argument(
        ...,
        metavar="SERVICE",
        help="A service of the stack, as stack.json names it: retrieval, engine, worker, coordinator-llm, "
        "coordinator, judge (replicas: engine-2, worker-2, coordinator-2, ...), front (their HAProxy).",
    ),
    state: Path = typer.Option(Path(".bcstack"), "--state", help="The state folder `bcstack up` used."),
    timeout: float = typer.Option(300.0, "--timeout", min=1, help="Seconds to wait for it to be healthy."),
) -> None:
    """Start one service of a `bcstack up` stack again, on the same ports with the same command line.

    A service that crashed or was killed is started; one still running is stopped first (SIGTERM,
    then SIGKILL after 20 s). Its new pid goes to STATE/stack.json, its output on in
    STATE/logs/SERVICE.log. The other services keep running: their clients reconnect.
    """
    from bcstack.stack import StackError
    from bcstack.stack import restart as stack_restart
    from core.kit.cli import fail

    try:
        stack_restart(state, name, timeout=timeout)
    except StackError as e:
        fail(str(e))
    typer.echo(f"restarted {name}")


@app.command("smoke")
def smoke(
    gateway: str = typer.Option(
        None, "--gateway", metavar="URL", help="The coordinator gateway; one episode runs through it."
    ),
    metrics: list[str] = typer.Option(
        [],
        "--metrics",
        metavar="NAME=URL",
        help="A service whose /metrics to check (retrieval, worker, engine, coordinator, coordinator-llm, "
        "judge, trainer); repeat for each.",
    ),
    state: Path = typer.Option(
        None,
        "--state",
        metavar="DIR",
        help="Read the gateway and every service from `bcstack up`'s stack.json.",
    ),
    question: str = typer.Option(None, "--question", help="The smoke episode's question."),
    timeout: float = typer.Option(
        300.0, "--timeout", help="Seconds to wait for the episode and each answer."
    ),
) -> None:
    """Is a deployed stack answering? One episode through the gateway, then every service's /metrics.

    Passes when the episode ends in a stored record whose status is not `error` and each /metrics
    serves the service's own bcstack_* metrics; exit 1 otherwise. The chart's `helm test` runs it."""
    from bcstack.smoke import DEFAULT_QUESTION, SmokeError, from_state, parse_targets, run_smoke
    from core.kit.cli import fail

    try:
        targets = parse_targets(metrics)
        if state is not None:
            gateway_from_state, listed = from_state(state)
            gateway = gateway or gateway_from_state
            targets = {**listed, **targets}
    except SmokeError as e:
        fail(str(e))
    if not gateway and not targets:
        fail("nothing to check: give --gateway, --metrics NAME=URL or --state DIR")
    checks = run_smoke(gateway, targets, question or DEFAULT_QUESTION, timeout)
    for check in checks:
        typer.echo(f"{'ok  ' if check.ok else 'FAIL'}  {check.name:24s} {check.detail}")
    failed = [c for c in checks if not c.ok]
    typer.echo(f"smoke: {len(checks) - len(failed)}/{len(checks)} checks passed")
    if failed:
        raise typer.Exit(1)


records_app = typer.Typer(help="Episode record files of the coordinator gateway.", no_args_is_help=True)
app.add_typer(records_app, name="records")

RECORD_FORMATS = ("jsonl", "sqlite")
SQLITE_HEADER = b"SQLite format 3\x00"


@records_app.command("export")
def records_export(
    records: str = typer.Option(
        ...,
        "--records",
        metavar="FILE|URL",
        help="The gateway's record file (may be in use by a running stack), or the gateways' PostgreSQL "
        "store (postgresql://USER@HOST/DB; the password from the URL or PGPASSWORD).",
    ),
    out: Path = typer.Option(..., "--out", metavar="FILE", help="Where the copy goes (replaced when there)."),
    fmt: str = typer.Option(
        "jsonl",
        "--format",
        metavar="jsonl|sqlite",
        help="jsonl: one record per line, oldest first; sqlite: a consistent copy of the record file.",
    ),
) -> None:
    """Copy every episode record out of a record file, consistently even while the gateway writes it.

    A plain `cp` of the live file can miss what SQLite still holds in its -wal file; both formats
    are read by `bcstack train` (trainer/data.py).
    """
    from core.kit.cli import fail
    from core.record_store import RecordStoreError, is_database_url, open_record_store

    if fmt not in RECORD_FORMATS:
        fail(f"--format {fmt}: choose {' or '.join(RECORD_FORMATS)}")
    if not is_database_url(records):
        _check_record_file(Path(records), out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open_record_store(records) as store:
            n = store.export(out, fmt=fmt)
    except (RecordStoreError, OSError) as e:
        fail(f"--records: {e}")
    typer.echo(f"{n} record(s) written to {out} ({fmt})")


def _check_record_file(records: Path, out: Path) -> None:
    """A record file exists, is not `out`, and is a record store, checked without changing it."""
    import contextlib
    import sqlite3

    from core.kit.cli import fail

    if not records.is_file():
        fail(f"--records {records}: no such file")
    if out.resolve() == records.resolve():
        fail("--out is the record file itself; give another path")
    with records.open("rb") as f:
        is_sqlite = f.read(len(SQLITE_HEADER)) == SQLITE_HEADER
    if not is_sqlite:
        fail(f"--records {records}: not a record store (not a SQLite file)")
    # Checked read-only first: opening a RecordStore switches a database to WAL, which a file that
    # is not a record store (a judge cache, say) should not have done to it.
    try:
        with contextlib.closing(sqlite3.connect(f"file:{records}?mode=ro", uri=True)) as conn:
            has_table = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'episodes'"
            ).fetchone()
    except sqlite3.Error as e:
        fail(f"--records {records}: cannot read it ({e})")
    if not has_table:
        fail(f"--records {records}: not a record store (no episodes table)")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"bcstack {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    pass


def _one_style(typer_app: typer.Typer) -> None:
    """Every command of the tree gets core.kit.cli.Command (a missing-arguments error names every
    missing one), unless it was mounted with a subclass of it (ServeCommand)."""
    for info in typer_app.registered_commands:
        if info.cls in (None, TyperCommand):  # Typer's default
            info.cls = Command
        elif not issubclass(info.cls, Command):
            raise TypeError(f"{info.name}: mounted with {info.cls.__name__}, not a core.kit.cli.Command")
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _one_style(group.typer_instance)


_one_style(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
