"""Trainer commands: a GRPO step from episode records, export to the serving format, verify.

Mounted by bcstack/cli.py (`bcstack train grpo|export`, `bcstack checkpoint verify`). torch and
transformers are imported inside the commands so that `bcstack --help` stays instant.
"""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from core import budget
from core.kit.cli import fail

app = typer.Typer(
    help="Trainer checkpoints: export to the serving format (BF16 safetensors) and verify.",
    no_args_is_help=True,
)


@app.callback()
def _group() -> None:
    # A callback keeps this a command group whichever commands are mounted.
    pass


def _print_summary(title: str, summary: dict[str, Any]) -> None:
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    exported = "source" in summary
    rows = [
        ("checkpoint", summary["path"]),
        *(
            [("source", summary["source"]), ("tokenizer from", summary["tokenizer_source"])]
            if exported
            else []
        ),
        ("architecture", f"{summary['architecture']} ({summary['model_type']})"),
        ("tensors", f"{summary['tensors']:,} ({summary['parameters']:,} parameters, {summary['dtype']})"),
        (
            "weights",
            f"{', '.join(summary['weight_files'])} ({summary['weight_bytes'] / 2**20:,.1f} MiB payload)",
        ),
        (
            "vocabulary",
            f"{summary['vocab_rows']:,} embedding rows, tokenizer {summary['tokenizer_tokens']:,} tokens"
            + (f" (trimmed from {summary['source_vocab_rows']:,})" if exported else "")
            + (", tied lm_head" if summary["tie_word_embeddings"] else ", untied lm_head"),
        ),
        ("chat template", summary["chat_template"]),
        ("SHA256SUMS", f"{summary['hashed_files']} files, all hashes match"),
    ]
    if summary.get("expect_config"):
        rows.append(("compatible with", summary["expect_config"]))
    if summary.get("unlisted_files"):
        rows.append(("not hashed", ", ".join(summary["unlisted_files"])))
    for name, value in rows:
        table.add_row(name, escape(str(value)))
    Console().print(table)


@app.command("export")
def export(
    model: Path = typer.Option(
        ...,
        "--model",
        help="Trained model folder: an HF export (config.json + safetensors or pytorch_model*.bin), "
        "possibly with padded embedding rows.",
    ),
    out: Path = typer.Option(
        ..., "--out", help="Folder to write the serving checkpoint into (missing or empty)."
    ),
    tokenizer: Path | None = typer.Option(
        None,
        "--tokenizer",
        help="Pinned tokenizer folder whose files and chat template are restored and whose size sets "
        "the embedding rows. Default: the --model folder.",
        show_default=False,
    ),
    vocab_size: int | None = typer.Option(
        None,
        "--vocab-size",
        min=1,
        help="Embedding rows to keep instead of the tokenizer's size (e.g. 151936 to match Qwen3-4B).",
        show_default=False,
    ),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors shard."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty --out folder."),
) -> None:
    """Export a trained checkpoint to the serving format and verify it.

    BF16 safetensors, embedding rows trimmed to the tokenizer's vocabulary (every kept row byte for
    byte), every tensor's key, shape and dtype checked, tokenizer files and chat template restored,
    SHA256SUMS written last. The export is built beside --out and renamed into place when verified.
    """
    from core.checkpoint import VerifyError
    from trainer.export import ExportError, export_checkpoint

    console = Console(stderr=True)
    started = time.perf_counter()
    with console.status("Starting …") as status:
        try:
            summary = export_checkpoint(
                model,
                out,
                tokenizer_dir=tokenizer,
                vocab_size=vocab_size,
                max_shard_size=max_shard_size,
                force=force,
                step=lambda description: status.update(f"{description} …"),
            )
        except (ExportError, VerifyError, OSError) as error:
            status.stop()
            fail(str(error))
    _print_summary(f"Exported and verified in {time.perf_counter() - started:.1f} s", summary)


@app.command("verify")
def verify(
    path: Path = typer.Argument(..., help="Serving checkpoint folder."),
    expect_config: Path | None = typer.Option(
        None,
        "--expect-config",
        help="config.json (or its folder) of the model the engine serves; the checkpoint must match its "
        "architecture, sizes and vocabulary.",
        show_default=False,
    ),
    vocab_size: int | None = typer.Option(
        None,
        "--vocab-size",
        min=1,
        help="Expected embedding rows when they differ from the tokenizer's size.",
        show_default=False,
    ),
) -> None:
    """Verify a serving checkpoint: hashes, tensors (key, shape, BF16), vocabulary, tokenizer files.

    Prints a summary, or the first problem as one `error:` line (exit 2).
    """
    from core.checkpoint import VerifyError, verify_checkpoint

    console = Console(stderr=True)
    started = time.perf_counter()
    with console.status("Verifying …") as status:
        try:
            summary = verify_checkpoint(path, expect_config=expect_config, vocab_size=vocab_size)
        except (VerifyError, OSError) as error:
            status.stop()
            fail(str(error))
    _print_summary(f"Verified in {time.perf_counter() - started:.1f} s", summary)


class GraderChoice(StrEnum):
    rule = "rule"


class MixedVersions(StrEnum):
    keep = "keep"
    drop = "drop"
    error = "error"


@app.command("grpo")
def grpo(
    records: Path = typer.Option(
        ...,
        "--records",
        help="Episode records: the coordinator gateway's SQLite record file or a JSONL file of records.",
    ),
    model: Path = typer.Option(
        ..., "--model", help="Policy to train: an HF model folder (its tokenizer goes to the export)."
    ),
    ref: Path = typer.Option(..., "--ref", help="Frozen KL reference (the SFT model), an HF model folder."),
    out: Path = typer.Option(
        ..., "--out", help="Run folder: metrics.jsonl, checkpoints/ and the serving export serving/."
    ),
    lr: float = typer.Option(1e-6, "--lr", min=0.0, help="AdamW learning rate (seed 000: 1e-6)."),
    micro_batch_tokens: int = typer.Option(
        budget.MAX_TOKENS,
        "--micro-batch-tokens",
        min=1,
        help="Token budget of one packed micro-batch; the longest trajectory must fit.",
    ),
    grader: GraderChoice = typer.Option(
        GraderChoice.rule,
        "--grader",
        help="How rewards and contributions are graded (rule: the embedded judge).",
    ),
    steps: int = typer.Option(
        1, "--steps", min=1, help="Train until the policy has taken this many updates."
    ),
    groups_per_step: int = typer.Option(
        8, "--groups-per-step", min=1, help="Question groups per update (seed 000: 8 prompts x 8 episodes)."
    ),
    mixed_versions: MixedVersions = typer.Option(
        "keep",
        "--mixed-versions",
        help="Worker trajectories generated across a hot reload (turns of several weight versions): "
        "keep them, drop them, or stop with an error.",
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest checkpoint under --out."),
    tp: int = typer.Option(
        1,
        "--tp",
        min=1,
        help="Tensor-parallel size. Under torchrun the job's processes form a [dp, tp] mesh, "
        "dp = world size / tp (FSDP2 on dp); one process takes --tp 1.",
    ),
) -> None:
    """One GRPO update per rollout batch of episode records (hierarchical credit, TIS, k3 KL).

    Grades the records, computes balanced worker-judge credit per question group, updates the policy
    with AdamW, logs each step to stdout and OUT/metrics.jsonl, checkpoints to OUT/checkpoints and
    exports the final policy to OUT/serving. Bad input is one `error:` line (exit 2).

    Several GPUs (or CPU processes, gloo): `torchrun --nproc_per_node N -m bcstack train grpo --tp T ...`
    runs the same step on every rank, each dp rank on its share of the micro-batches; rank 0 alone
    prints, writes metrics.jsonl and exports; checkpoints are sharded (DCP) and resume at any layout.
    """
    from trainer.distributed import LayoutError, init_layout

    try:
        layout = init_layout(tp)  # before loading anything: joins the torchrun job, if any
    except LayoutError as error:
        fail(str(error))
    from core.checkpoint import VerifyError
    from trainer.checkpoint import CheckpointError
    from trainer.data import SampleError
    from trainer.export import ExportError
    from trainer.grpo import GRPOError, rule_grades, train

    graders = {GraderChoice.rule: rule_grades}
    try:
        train(
            records,
            model,
            ref,
            out,
            lr=lr,
            micro_batch_tokens=micro_batch_tokens,
            grader=graders[grader],
            steps=steps,
            resume=resume,
            groups_per_step=groups_per_step,
            mixed_versions=mixed_versions.value,
            layout=layout,
            say=typer.echo,  # train() silences every rank but 0
        )
    except (GRPOError, SampleError, CheckpointError, ExportError, VerifyError, OSError) as error:
        fail(" ".join(str(error).split()))
    except ValueError as error:  # a record that is not JSON, a trajectory over the micro-batch budget
        fail(" ".join(str(error).split()))
    layout.close()
