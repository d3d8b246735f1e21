"""`bcstack train sft`: seed 001's SFT from episode records and chat JSONL, with its mixture table.

Mounted by bcstack/cli.py. torch and transformers are imported inside the command.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from core.kit.cli import fail, need_file, need_model


def _print_mixture(console: Console, mixture, steps: int, batch: int, epochs: float) -> None:  # type: ignore[no-untyped-def]
    table = Table(title="SFT mixture", title_justify="left")
    for column in ("source", "source rows", "how", "rows", "supervised tokens", "tokens"):
        table.add_column(column, justify="left" if column in ("source", "how") else "right")
    for row in mixture.table:
        table.add_row(
            row["name"],
            f"{row['source_rows']:,}",
            row["how"],
            f"{row['rows']:,}",
            f"{row['supervised_tokens']:,}",
            f"{row['tokens']:,}",
        )
    total = len(mixture.rows)
    passes = f"{epochs:g} passes, " if epochs != 1 else ""
    table.caption = (
        f"{total:,} rows, seed {mixture.seed}; {passes}{steps:,} steps of {batch} rows (floor division: "
        f"{int(total * epochs) - steps * batch} rows of the last partial batch are not trained on)"
    )
    console.print(table)


def sft(
    model: Path = typer.Option(
        ..., "--model", help="Model folder to start from (HF format, with its tokenizer)."
    ),
    source: list[str] = typer.Option(
        ...,
        "--source",
        help="A source, repeatable: NAME=PATH[:repeat=N][:match=OTHER][:fraction=F][:tokens=N]"
        "[:only_correct=false]. PATH is episode records (the gateway's SQLite file or a records JSONL "
        "export; only correctly answered episodes unless only_correct=false) or chat JSONL ({messages, "
        "source?, supervise?}). Seed 001: core=CORE:repeat=3 gate=GATE:match=core.",
    ),
    out: Path = typer.Option(
        ..., "--out", help="Run folder: checkpoints/, metrics.jsonl, mixture.json, serving/."
    ),
    eval_source: Path | None = typer.Option(
        None,
        "--eval-source",
        help="Held-out rows (records or chat JSONL) whose loss is logged as eval_loss.",
        show_default=False,
    ),
    eval_every: int = typer.Option(25, "--eval-every", min=1, help="Steps between held-out losses."),
    lr: float = typer.Option(1e-5, "--lr", min=0.0, help="Peak learning rate (seed 001: 1e-5)."),
    min_lr: float = typer.Option(1e-6, "--min-lr", min=0.0, help="Cosine floor (seed 001: 1e-6)."),
    warmup: float = typer.Option(0.1, "--warmup", min=0.0, max=1.0, help="Warm-up share of the steps."),
    weight_decay: float = typer.Option(0.1, "--weight-decay", min=0.0, help="AdamW weight decay."),
    beta1: float = typer.Option(0.9, "--beta1", min=0.0, max=1.0, help="AdamW beta1."),
    beta2: float = typer.Option(0.95, "--beta2", min=0.0, max=1.0, help="AdamW beta2."),
    global_batch: int = typer.Option(32, "--global-batch", min=1, help="Rows per optimizer step."),
    micro_batch_tokens: int = typer.Option(
        8192, "--micro-batch-tokens", min=16, help="Token budget of one packed micro-batch."
    ),
    epochs: float = typer.Option(1.0, "--epochs", min=0.0, help="Passes over the constructed mixture."),
    seed: int = typer.Option(42, "--seed", help="Mixture sampling and shuffling seed (seed 001: 42)."),
    checkpoint_every: int = typer.Option(50, "--checkpoint-every", min=1, help="Steps between checkpoints."),
    max_steps: int | None = typer.Option(
        None,
        "--max-steps",
        min=1,
        help="Stop after this many steps in all (continue with --resume).",
        show_default=False,
    ),
    resume: bool = typer.Option(
        False, "--resume/--no-resume", help="Continue from the newest checkpoint under OUT."
    ),
    report_to: str = typer.Option(
        "", "--report-to", help="Also log to: tensorboard, wandb (comma-separated)."
    ),
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", help="Serve bcstack_trainer_* on this port.", show_default=False
    ),
    tp: int = typer.Option(
        1,
        "--tp",
        min=1,
        help="Tensor-parallel size. Under torchrun the job's processes form a [dp, tp] mesh, "
        "dp = world size / tp (FSDP2 on dp); one process takes --tp 1.",
    ),
) -> None:
    """Supervised fine-tuning (seed 001): a token-balanced mixture of sources, one epoch, AdamW cosine.

    Prints and writes (OUT/mixture.json) the constructed mixture (rows and supervised tokens per
    source), logs every step to OUT/metrics.jsonl (and TensorBoard / W&B), checkpoints, and exports
    the final model to OUT/serving in the serving format (`bcstack checkpoint verify` passes).

    Several GPUs (or CPU processes, gloo): `torchrun --nproc_per_node N -m bcstack train sft --tp T ...`
    (dp = N / T); rank 0 alone prints, logs and exports; checkpoints are sharded and resume at any layout.
    """
    from trainer.layout import early_layout_error
    from trainer.sft_data import SFTDataError, SourceSpec  # no torch: the cheap checks come first

    need_model("--model", model)
    try:
        specs = [SourceSpec.parse(text) for text in source]
    except SFTDataError as e:
        fail(str(e))
    for spec in specs:
        if not spec.path.is_file():
            fail(f"source {spec.name}: no such file {spec.path}")
    if eval_source is not None:
        need_file("--eval-source", eval_source)
    layout_error = early_layout_error(tp)  # before torch's imports: a bad --tp is one line at once
    if layout_error is not None:
        fail(layout_error)

    from transformers import AutoTokenizer

    from trainer.distributed import init_layout
    from trainer.layout import LayoutError
    from trainer.sft import SFTConfig, SFTError, epoch_steps, train_sft
    from trainer.sft_data import build_mixture, is_chat_jsonl, load_chat_jsonl, load_record_samples
    from trainer.sinks import RunSinks, SinkError

    try:
        layout = init_layout(tp)  # before loading anything: joins the torchrun job, if any
    except LayoutError as e:
        fail(str(e))
    console = Console(stderr=True, quiet=not layout.is_main)
    config = SFTConfig(
        lr=lr,
        min_lr=min_lr,
        warmup_fraction=warmup,
        weight_decay=weight_decay,
        betas=(beta1, beta2),
        global_batch=global_batch,
        micro_batch_tokens=micro_batch_tokens,
        epochs=epochs,
        seed=seed,
        checkpoint_every=checkpoint_every,
    )
    tokenizer = AutoTokenizer.from_pretrained(model)

    def load(path: Path, name: str, only_correct: bool = True):  # type: ignore[no-untyped-def]
        if not path.is_file():
            fail(f"source {name}: no such file {path}")
        if is_chat_jsonl(path):
            rows, refused = load_chat_jsonl(path, tokenizer, source=name)
            for line in refused[:5]:
                console.print(f"[yellow]refused[/yellow] {line}")
            if len(refused) > 5:
                console.print(f"[yellow]refused[/yellow] … and {len(refused) - 5} more rows")
            console.print(f"{name}: {len(rows):,} chat rows from {path} ({len(refused)} refused)")
            return rows
        rows, counts = load_record_samples(path, source=name, only_correct=only_correct)
        console.print(
            f"{name}: {counts['samples']:,} trajectories from {counts['records']:,} episode records in "
            f"{path} "
            f"({counts['incorrect']} of wrong answers left out, {counts['rejected']} rejected)"
        )
        return rows

    try:
        pools = {s.name: load(s.path, s.name, s.only_correct) for s in specs}
        mixture = build_mixture(pools, specs, seed=seed)
        eval_rows = load(eval_source, "eval") if eval_source is not None else []
    except SFTDataError as e:
        fail(str(e))
    steps = epoch_steps(len(mixture.rows), config)
    _print_mixture(console, mixture, steps, global_batch, epochs)
    if layout.is_main:  # rank 0 alone writes the run folder's files
        out.mkdir(parents=True, exist_ok=True)
        (out / "mixture.json").write_text(
            json.dumps(
                {"seed": seed, "rows": len(mixture.rows), "steps": steps, "digest": mixture.digest(),
                 "sources": list(mixture.table)},
                indent=2,
            ) + "\n"
        )  # fmt: skip
    wanted = {name.strip() for name in report_to.split(",") if name.strip()}
    started = time.perf_counter()
    try:
        run_sinks = (
            RunSinks(
                out,
                wanted,
                prometheus_port=metrics_port,
                run_name="sft",
                config={"model": str(model), "sources": source, **config.as_dict()},
                resume_update=0 if not resume else _last_step(out),
            )
            if layout.is_main
            else nullcontext(None)
        )
        with run_sinks as sinks:

            def show(step: int, total: int, m: dict) -> None:  # type: ignore[type-arg]
                held = f" eval_loss {m['eval_loss']:.4f}" if "eval_loss" in m else ""
                console.print(
                    f"step {step}/{total} loss {m['loss']:.4f}{held} lr {m['lr']:.2e} "
                    f"{m['train_tokens_per_s']:,.0f} tok/s",
                    highlight=False,
                )

            summary = train_sft(
                model,
                mixture,
                out,
                config=config,
                resume=resume,
                max_steps=max_steps,
                eval_rows=eval_rows,
                eval_every=eval_every,
                on_metrics=sinks.log if sinks is not None else None,
                on_step=show,
                layout=layout,
                say=console.print,
            )
    except (SFTError, SinkError, ValueError) as e:
        fail(str(e))
    seconds = time.perf_counter() - started
    if "serving" in summary:
        console.print(
            f"trained {summary['steps']} steps ({summary['tokens']:,} tokens) in {seconds:.0f} s; "
            f"serving export in {summary['serving']} ({summary['export_seconds']:.1f} s)"
        )
    else:
        console.print(
            f"stopped after step {summary['steps']} of {summary['total_steps']}; continue with --resume"
        )
    layout.close()


def _last_step(out: Path) -> int:
    from trainer.checkpoint import STATE_FILE, latest_checkpoint

    latest = latest_checkpoint(out / "checkpoints")
    return 0 if latest is None else int(json.loads((latest / STATE_FILE).read_text())["step"])


def gate_rows(
    records: Path = typer.Option(
        ..., "--records", help="Episode records: the gateway's SQLite file or a records JSONL export."
    ),
    tokenizer: Path = typer.Option(
        ..., "--tokenizer", help="The worker's tokenizer (model folder), to read the trajectories' token ids."
    ),
    out: Path = typer.Option(..., "--out", help="Gate rows to write (chat JSONL, core/gate.py's format)."),
    hard_negative_repeat: int = typer.Option(
        2,
        "--hard-negative-repeat",
        min=1,
        help="Copies of each hard negative (CONTINUE with the answer shown).",
    ),
    all_episodes: bool = typer.Option(
        False, "--all/--no-all", help="Use every episode, not only the correctly answered ones."
    ),
) -> None:
    """Gate rows for the runtime STOP gate from expert episode records (seed 001's second SFT source).

    One row per observation: STOP when the worker's next turn is its finish, CONTINUE otherwise; the
    CONTINUEs whose observation already shows the gold answer are hard negatives, repeated.
    """
    need_file("--records", records)  # before transformers' import: seconds
    if not (tokenizer / "tokenizer_config.json").is_file() and not (tokenizer / "tokenizer.json").is_file():
        fail(f"--tokenizer {tokenizer}: no tokenizer files there")

    from transformers import AutoTokenizer

    from core.atomic import atomic_write_text
    from trainer.gate_rows import gate_rows_from_records

    try:
        rows, counts = gate_rows_from_records(
            records,
            AutoTokenizer.from_pretrained(tokenizer),
            only_correct=not all_episodes,
            hard_negative_repeat=hard_negative_repeat,
        )
    except (ValueError, OSError) as e:
        fail(str(e))
    atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
    typer.echo(
        f"{counts['rows']:,} gate rows from {counts['trajectories']:,} trajectories of {counts['records']:,} "
        f"episodes: {counts['stop']:,} stop, {counts['continue']:,} continue "
        f"({counts['hard_negative']:,} hard negatives, x{hard_negative_repeat}) -> {out}"
    )
