"""Trainer checkpoint commands: export to the serving format, verify a serving checkpoint.

Mounted by bcstack/cli.py (`bcstack train export`, `bcstack checkpoint verify`). torch and
transformers are imported inside the commands so that `bcstack --help` stays instant.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from services.common.cli import fail

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
    from trainer.export import ExportError, VerifyError, export_checkpoint

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
    from trainer.export import VerifyError, verify_checkpoint

    console = Console(stderr=True)
    started = time.perf_counter()
    with console.status("Verifying …") as status:
        try:
            summary = verify_checkpoint(path, expect_config=expect_config, vocab_size=vocab_size)
        except (VerifyError, OSError) as error:
            status.stop()
            fail(str(error))
    _print_summary(f"Verified in {time.perf_counter() - started:.1f} s", summary)
