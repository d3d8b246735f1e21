"""`bcstack model ...`: build the tiny Qwen3-architecture model kit for the embedded default.

torch and transformers are imported inside the command so that `bcstack --help` stays instant.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    help="Model kits: build the tiny Qwen3-architecture model for the embedded default.", no_args_is_help=True
)


@app.callback()
def _group() -> None:
    # A callback keeps `model` a command group even while it holds a single command.
    pass


_TINY_HELP = (
    "Build a tiny Qwen3 model, its tokenizer and chat template, locally and deterministically.\n\n"
    "Trains a byte-level BPE tokenizer with Qwen3's special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, "
    "<think>, </think>, <tool_call>, <tool_response>, ...) on the corpus, attaches the keep-thinking "
    "Qwen3 chat template and saves a randomly initialised Qwen3ForCausalLM (float32 safetensors) with "
    "bcstack_model.json, a manifest of what built it.\n\n"
    "Nothing is downloaded. The same arguments always give byte-identical files. The folder loads with "
    "transformers' AutoTokenizer and AutoModelForCausalLM and is served by the embedded CPU engine."
)


@app.command("tiny", help=_TINY_HELP)
def tiny(
    out: Path = typer.Option(
        ..., "--out", help="Folder to write the kit into. Must be missing or empty unless --force is given."
    ),
    corpus: Path | None = typer.Option(
        None,
        "--corpus",
        help=(
            "BrowseComp-Plus corpus JSONL (one object per line with docid, text, url) to train the tokenizer "
            "on. Default: the fixed toy text (the corpus and questions of generate_world(n_docs=2000, "
            "seed=7919), a world kept for the tokenizer), so one kit serves every toy world."
        ),
        show_default=False,
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the model's random initialisation."),
    vocab_size: int = typer.Option(
        4096,
        "--vocab-size",
        min=256,
        help="Byte-level BPE vocabulary (256 bytes + merges); Qwen3's 9 added tokens come on top.",
    ),
    hidden_size: int = typer.Option(64, "--hidden-size", min=8, help="Model width."),
    layers: int = typer.Option(2, "--layers", min=1, help="Decoder layers."),
    heads: int = typer.Option(4, "--heads", min=1, help="Query heads (head size = hidden / heads)."),
    kv_heads: int = typer.Option(2, "--kv-heads", min=1, help="Key/value heads (GQA; divides --heads)."),
    intermediate_size: int | None = typer.Option(
        None, "--intermediate-size", min=8, help="MLP width. Default: 3 x hidden.", show_default=False
    ),
    number_digits: int = typer.Option(
        1,
        "--number-digits",
        min=1,
        max=8,
        help="Digit runs the pre-tokenizer keeps together: 1 is Qwen3's (every digit a token); 4 lets "
        "a year be one token, which a model trained from scratch copies far more easily.",
    ),
    force: bool = typer.Option(False, "--force/--no-force", help="Replace a non-empty --out folder."),
) -> None:
    """Build the tiny model kit (see _TINY_HELP)."""
    from devkit.modelkit.build import MANIFEST_FILE, OutputDirError, build_tiny_kit
    from devkit.modelkit.corpus import CorpusError
    from devkit.modelkit.model import TinyQwen3Shape

    console = Console(stderr=True)
    started = time.perf_counter()
    stage: dict[str, float | str] = {}

    def close_stage() -> None:
        if stage:
            console.print(
                f"[green]✓[/] {stage['name']} ({time.perf_counter() - stage['at']:.1f} s)", highlight=False
            )

    with console.status("Starting …") as status:

        def step(description: str) -> None:
            close_stage()
            stage.update(name=description, at=time.perf_counter())
            status.update(f"{description} …")

        if hidden_size % heads or heads % kv_heads:
            console.print("[red]error:[/] --hidden-size must divide by --heads, and --heads by --kv-heads")
            raise typer.Exit(code=1)
        shape = TinyQwen3Shape(
            hidden_size=hidden_size,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=hidden_size // heads,
            intermediate_size=intermediate_size or 3 * hidden_size,
        )
        try:
            manifest = build_tiny_kit(
                out,
                corpus_path=corpus,
                seed=seed,
                bpe_vocab_size=vocab_size,
                shape=shape,
                force=force,
                step=step,
                number_digits=number_digits,
            )
        except (CorpusError, OutputDirError) as error:
            console.print("[red]error:[/]", escape(str(error)), highlight=False, soft_wrap=True)
            raise typer.Exit(code=1) from None
        close_stage()

    model = manifest["model"]
    tokenizer = manifest["tokenizer"]
    console.print(
        f"Wrote {escape(str(out))} in {time.perf_counter() - started:.1f} s: {model['architecture']} with "
        f"{model['parameters']:,} parameters ({model['dtype']}), {tokenizer['size']:,} tokens "
        f"(config vocab_size {model['config_vocab_size']:,}), "
        f"corpus {manifest['corpus']['documents']:,} documents. Manifest: {escape(str(out / MANIFEST_FILE))}",
        highlight=False,
    )
