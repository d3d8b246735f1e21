"""`bcstack toyworld ...`: generate the toy world."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="The toy world: a fictional corpus and questions in the BrowseComp-Plus formats.",
    no_args_is_help=True,
)


@app.command()
def generate(
    out: Path = typer.Option(..., "--out", help="Directory to write (must not exist or be empty)."),
    docs: int = typer.Option(2000, "--docs", min=1, help="Number of documents in corpus.jsonl."),
    seed: int = typer.Option(0, "--seed", help="Random seed: the same seed gives byte-identical files."),
    per_tier: int = typer.Option(
        50,
        "--questions-per-tier",
        min=0,
        help="Test questions per tier (easy/medium/hard); 0 for a world that only gives training questions.",
    ),
    train_easy: int = typer.Option(0, "--train-easy", min=0, help="Easy questions in the train split."),
    train_medium: int = typer.Option(
        100, "--train-medium", min=0, help="Medium questions in the train split."
    ),
    train_hard: int = typer.Option(50, "--train-hard", min=0, help="Hard questions in the train split."),
) -> None:
    """Write corpus.jsonl, questions.jsonl (test split), train.jsonl, TREC qrels and world.json.

    Easy questions need one document, medium two hops, hard three hops through pages that have
    near-duplicate distractors. Every answer is unique and checked against the corpus. No train
    question reads a document that a test question reads.
    """
    import time

    from rich.console import Console

    from devkit.toyworld.generator import ToyWorldError, generate_world, write_world

    console = Console(stderr=True)
    start = time.perf_counter()
    try:
        with console.status(f"generating {docs:,} documents (seed {seed})"):
            world = generate_world(
                docs,
                seed,
                questions_per_tier=per_tier,
                train_easy=train_easy,
                train_medium=train_medium,
                train_hard=train_hard,
            )
            write_world(world, out)
    except ToyWorldError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    m = world.manifest()
    tiers = ", ".join(f"{k} {v}" for k, v in m["test_tiers"].items())
    console.print(
        f"wrote {out}: {m['documents']:,} documents, {m['test_questions']} test questions ({tiers}), "
        f"{m['train_questions']} train questions in {time.perf_counter() - start:.1f}s"
    )
