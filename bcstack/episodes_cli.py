"""`bcstack episodes show ID`: one recorded episode in the terminal, as the gateway's /ui page shows it.

The record comes from a gateway (`--gateway URL`, or the one `bcstack up --state DIR` started) or
straight from a record file (`--records FILE`); worker token ids are decoded with the worker model's
tokenizer (`--tokenizer DIR`; with `--state`, the stack's own). Both this and the HTML page render
`services.coordinator.viewer`'s view-model, so they show the same content.

Exit codes: 0 shown, 1 no such episode, 2 bad input (options, an unreachable gateway, a broken record).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from core.kit.cli import fail
from core.records import EpisodeRecord, RecordError
from services.coordinator import viewer

app = typer.Typer(
    help="Read recorded episodes as a person would.", no_args_is_help=True, add_completion=False
)

DEFAULT_STATE = Path(".bcstack")
# Characters of a folded text (a long page, a system prompt) printed without --full.
PREVIEW_CHARS = 400


@app.callback()
def episodes() -> None:
    """Recorded episodes of the coordinator gateway."""  # a callback keeps `show` a subcommand


def _from_gateway(gateway: str, episode_id: str) -> dict:
    import httpx

    url = f"{gateway.rstrip('/')}/v1/episodes/{episode_id}"
    try:
        r = httpx.get(url, timeout=30)
    except httpx.HTTPError as exc:
        fail(f"the gateway {gateway} is unreachable: {exc}")
    if r.status_code == 404:
        fail(f"no recorded episode {episode_id!r} at {gateway}", 1)
    if r.status_code != 200:
        fail(f"the gateway {gateway} answered {r.status_code}: {' '.join(r.text.split())[:200]}")
    try:
        return r.json()
    except ValueError:
        fail(f"the gateway {gateway} answered something that is not JSON")


def _from_records(target: str, episode_id: str) -> dict:
    from core.record_store import RecordStoreError, is_database_url, open_record_store

    if not is_database_url(target) and not Path(target).is_file():
        fail(f"--records {target}: no such file")
    try:
        with open_record_store(target) as store:
            data = store.get(episode_id)
            where = store.location
    except RecordStoreError as exc:
        fail(str(exc))
    if data is None:
        fail(f"no recorded episode {episode_id!r} in {where}", 1)
    return data


def _stack(state: Path) -> tuple[str, Path | None]:
    """The gateway URL of `bcstack up --state DIR`, and the tokenizer its workers use."""
    from bcstack.stack import STATE_FILE, StackError, gateway_url, read_state

    try:
        info = read_state(state)
    except StackError as exc:
        fail(str(exc))
    if info is None:
        fail(
            f"no stack described at {state / STATE_FILE}; run `bcstack up --state {state}`, or give --gateway"
        )
    gateway = gateway_url(info)
    if not gateway:
        fail(f"{state / STATE_FILE} lists no coordinator gateway")
    worker = Path(str(info.get("worker", "")))
    candidates = [worker, Path(str((info.get("assets") or {}).get("tiny", "")))]
    tokenizer = next((c for c in candidates if str(c) and (c / "tokenizer.json").is_file()), None)
    return gateway, tokenizer


@app.command("show")
def show(
    episode_id: str = typer.Argument(..., metavar="ID", help="The episode id (as in GET /v1/episodes)."),
    gateway: str = typer.Option(None, "--gateway", metavar="URL", help="The coordinator gateway's HTTP URL."),
    state: Path = typer.Option(
        None,
        "--state",
        metavar="DIR",
        help="Read the gateway (and the tokenizer) from `bcstack up`'s stack.json.",
    ),
    records: str = typer.Option(
        None,
        "--records",
        metavar="FILE|URL",
        help="Read the records directly (no gateway needed): the gateway's SQLite file or the gateways' "
        "PostgreSQL store (postgresql://USER@HOST/DB; the password from the URL or PGPASSWORD).",
    ),
    tokenizer: Path = typer.Option(
        None,
        "--tokenizer",
        metavar="DIR",
        help="The worker model's tokenizer folder, to decode trajectories; without one, counts and ids only.",
    ),
    full: bool = typer.Option(
        False, "--full/--no-full", help="Print long texts whole (pages, prompts, thinking)."
    ),
    mask: bool = typer.Option(
        False, "--mask/--no-mask", help="Also print each trajectory's tokens with the loss mask."
    ),
) -> None:
    """Print one recorded episode, as the gateway's /ui page shows it.

    The question and answers, the judge's verdict, each coordinator turn, and each branch's worker
    turn by turn: text (thinking apart), tool calls and outcomes, observations, tokens against the
    budget and turns against the limit, weight versions, timings."""
    given = [
        name for name, value in (("--gateway", gateway), ("--state", state), ("--records", records)) if value
    ]
    if len(given) > 1:
        fail(f"give one of --gateway, --state, --records (got {' and '.join(given)})")
    if not given:
        if not (DEFAULT_STATE / "stack.json").is_file():
            fail("where is the episode? give --gateway URL, --state DIR or --records FILE")
        state = DEFAULT_STATE
    stack_tokenizer = None
    if records is not None:
        data = _from_records(records, episode_id)
    else:
        if state is not None:
            gateway, stack_tokenizer = _stack(state)
        data = _from_gateway(gateway, episode_id)
    try:
        record = EpisodeRecord.load(data)
    except RecordError as exc:
        fail(f"the record is broken: {exc}")
    decoder = None
    if tokenizer is not None or stack_tokenizer is not None:
        try:
            decoder = viewer.TokenDecoder.load(tokenizer or stack_tokenizer)
        except viewer.DecoderError as exc:
            fail(str(exc))
    Console().print(render_episode(viewer.episode_view(record, decoder), full=full, mask=mask))


# --- rendering ---------------------------------------------------------------------------------------


def _bar(bar: viewer.Bar) -> Table:
    row = Table.grid(padding=(0, 1))
    limit = f"{bar.limit:,}" if bar.limit else "no limit recorded"
    row.add_row(
        Text(f"{bar.label:>18}", style="dim"),
        ProgressBar(
            total=max(bar.limit, 1),
            completed=min(bar.used, max(bar.limit, 1)),
            width=30,
            complete_style="red" if bar.over else "blue",
        ),  # fmt: skip
        Text(f"{bar.used:,} / {limit}"),
    )
    return row


def _long(text: str, full: bool, style: str = "") -> Text:
    if full or len(text) <= PREVIEW_CHARS:
        return Text(text, style=style)
    return Text(text[:PREVIEW_CHARS], style=style) + Text(
        f" … ({len(text):,} characters; --full prints all)", style="dim italic"
    )


def _model(m: viewer.ModelText, full: bool) -> list[RenderableType]:
    out: list[RenderableType] = []
    if m.thinking is not None:
        out.append(Text("thinking: ", style="dim bold") + _long(m.thinking, full, "dim italic"))
    if m.text:
        out.append(Text(m.text))
    return out


def _verdict(label: str) -> Text:
    style = {"correct": "bold green", "incorrect": "bold red"}.get(label, "yellow")
    return Text(label, style=style)


def _branch(b: viewer.BranchView, view: viewer.EpisodeView, full: bool, mask: bool) -> Panel:
    parts: list[RenderableType] = []
    meta = f"worker episode {b.episode_id} · replica {b.replica or '-'} · {b.attempts} attempt(s)"
    meta += f" · {b.seconds:.2f} s"
    if b.started_offset is not None:
        meta += f" · started at +{b.started_offset:.2f} s"
    if b.stop_reason:
        meta += f" · stop reason {b.stop_reason}"
    if b.weight_versions:
        meta += f" · weights {', '.join(b.weight_versions)}"
    parts += [Text(meta, style="dim"), _bar(b.tokens), _bar(b.turns_bar)]
    if b.error:
        parts.append(Text(b.error, style="red"))
    parts += [Text(f"event: {e}", style="yellow") for e in b.events]
    parts.append(Text("task: ", style="bold") + _long(b.prompt.text, full))
    for t in b.turns:
        head = f"turn {t.index + 1} · weights {t.weight_version or '?'} · {t.generated_tokens:,} generated"
        parts.append(Text(head + (f" · {t.finish_reason}" if t.finish_reason else ""), style="bold cyan"))
        parts += (
            _model(t.model, full) if t.model is not None else [Text("(model text not decoded)", style="dim")]
        )
        for c in t.tool_calls:
            line = (
                Text("→ ")
                + Text(c.signature, style="bold")
                + Text(" ")
                + Text(c.outcome, style="green" if c.ok else "red")
            )
            if c.error:
                line += Text(f" {c.error}", style="red")
            if c.docids:
                line += Text(f"  docids {', '.join(c.docids)}", style="dim")
            parts.append(line)
        if t.observation is not None:
            parts.append(
                Text(f"observation ({t.observation_tokens:,} tokens): ", style="bold dim")
                + _long(t.observation.text, full, "dim")
            )
    if b.report.get("answer"):
        parts.append(
            Text("report: ", style="bold")
            + Text(f"{b.report['answer']} ({b.report.get('confidence') or '?'})")
        )
    if b.mask:
        parts.append(
            Text(f"loss mask: {b.trained_tokens:,} of {b.total_tokens:,} tokens trained on", style="bold")
        )
        if mask:
            tokens = Text()
            for s in b.mask:
                if s.folded and not full:
                    tokens.append(
                        f"[{s.tokens:,} tokens not trained on; --full prints them]", style="dim italic"
                    )
                else:
                    tokens.append(s.text, style="black on green" if s.trained else "dim")
            parts.append(tokens)
    title = Text(f"Branch {b.branch}: {b.description or '(no description)'}  ", style="bold") + Text(
        b.status, style="green" if b.status == "finish" else "red"
    )
    if b.contribution is not None:
        title += Text(f"  contribution {b.contribution:.2f}", style="magenta")
    return Panel(Group(*parts), title=title, title_align="left", border_style="blue")


def render_episode(view: viewer.EpisodeView, *, full: bool = False, mask: bool = False) -> Group:
    """The whole episode as Rich renderables (what `show` prints)."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="dim")
    head.add_column()
    for key, value in (
        ("question id", view.question_id or "-"),
        ("group", view.group_id or "-"),
        ("endpoint", f"{view.endpoint} ({view.endpoint_model})" if view.endpoint_model else view.endpoint),
        ("created", view.created),
        ("finished", view.finished),
        ("seconds", f"{view.seconds:.2f}"),
        ("weight versions", ", ".join(view.weight_versions) or "-"),
        ("worker tokens", f"{view.worker_tokens:,}"),
    ):
        head.add_row(key, Text(value))
    title = Text(f"Episode {view.episode_id}  ", style="bold") + Text(
        view.status, style="green" if view.status == "finish" else "red"
    )
    parts: list[RenderableType] = [Panel(head, title=title, title_align="left")]
    if view.error:
        parts.append(Text(view.error, style="red"))
    if view.decoder_note:
        parts.append(Text(view.decoder_note, style="yellow"))
    parts.append(Text("question: ", style="bold") + Text(view.question))
    if view.gold_answer is not None:
        parts.append(Text("gold answer: ", style="bold") + Text(view.gold_answer))
    parts.append(Text("final answer: ", style="bold") + Text(view.answer or "(none)") + Text(
        f"  confidence {view.confidence}" if view.confidence else "", style="dim"
    ))  # fmt: skip
    if view.explanation:
        parts.append(Text(view.explanation, style="dim"))
    if view.verdict is not None:
        judge = Text("judge: ", style="bold") + _verdict(view.verdict.label)
        if view.verdict.extracted_final_answer:
            judge += Text(f"  extracted answer {view.verdict.extracted_final_answer!r}")
        if view.verdict.grader_version:
            judge += Text(f"  grader {view.verdict.grader_version}", style="dim")
        parts.append(judge)
    else:
        parts.append(Text("judge: not graded in this record", style="dim"))
    parts += [_bar(view.coordinator_turns), _bar(view.branches)]
    if view.system_prompt is not None:
        parts.append(
            Text("coordinator system prompt: ", style="bold dim")
            + _long(view.system_prompt.text, full, "dim")
        )
    for turn in view.turns:
        meta = (
            f"{turn.seconds:.2f} s model · {turn.workers_seconds:.2f} s workers"
            f" · {turn.total_seconds:.2f} s in all"
            f" · {turn.prompt_tokens:,} prompt / {turn.completion_tokens:,} completion tokens"
        )
        parts += [Rule(f"Coordinator turn {turn.index + 1}", align="left"), Text(meta, style="dim")]
        parts += _model(turn.model, full)
        parts += [Text(e, style="red") for e in turn.errors]
        parts += [_branch(b, view, full, mask) for b in turn.branches]
        if turn.reply is not None:
            parts.append(
                Text("the coordinator read next: ", style="bold dim") + _long(turn.reply.text, full, "dim")
            )
    if view.unplaced_branches:
        parts.append(Rule("Branches of no recorded coordinator turn", align="left"))
        parts += [_branch(b, view, full, mask) for b in view.unplaced_branches]
    return Group(*parts)
