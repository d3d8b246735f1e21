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
    dev_per_tier: int = typer.Option(
        0,
        "--dev-per-tier",
        min=0,
        help="Dev questions per tier (dev.jsonl): for every choice the test split must not make. 0: no dev "
        "split, the world this generator made before it had one.",
    ),
) -> None:
    """Write corpus.jsonl, questions.jsonl (test split), dev.jsonl, train.jsonl, TREC qrels and world.json.

    Easy questions need one document, medium two hops, hard three hops through pages that have
    near-duplicate distractors. Every answer is unique and checked against the corpus. No train
    question reads a document that a test or dev question reads; no dev question reads a test one's.
    """
    import time

    from rich.console import Console

    from core.kit.cli import fail
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
                dev_per_tier=dev_per_tier,
            )
            write_world(world, out)
    except ToyWorldError as e:
        fail(str(e))  # one unwrapped line: rich would fold a long path across lines
    m = world.manifest()
    tiers = ", ".join(f"{k} {v}" for k, v in m["test_tiers"].items())
    console.print(
        f"wrote {out}: {m['documents']:,} documents, {m['test_questions']} test questions ({tiers}), "
        + (f"{m['dev_questions']} dev questions, " if m.get("dev_questions") else "")
        + f"{m['train_questions']} train questions in {time.perf_counter() - start:.1f}s"
    )


@app.command()
def math(
    out: Path = typer.Option(..., "--out", help="Directory to write (must not exist or be empty)."),
    domain: str = typer.Option(
        "arithmetic",
        "--domain",
        help="arithmetic (multi-step word problems) or sequence (next term of a progression).",
    ),
    train: int = typer.Option(
        1600,
        "--train",
        min=1,
        help="Training prompts (train + 64 dev + test fit in arithmetic's 1,944 distinct problems).",
    ),
    test: int = typer.Option(
        200, "--test", min=1, help="Held-out test prompts (plus 64 development prompts)."
    ),
    seed: int = typer.Option(0, "--seed", help="Random seed: the same seed gives byte-identical files."),
    force: bool = typer.Option(False, "--force/--no-force", help="Overwrite a non-empty --out."),
) -> None:
    """Write a toy single-turn domain for the seed-004 specialists, in DAPO-Math-17k's row format.

    train.jsonl, dev.jsonl (64 prompts), test.jsonl: rows {id, domain, prompt, label}; the prompt
    asks for an "Answer:" last line and the label is the numeric answer. sft.jsonl: the training
    prompts with worked replies (chat rows, thinking disabled) for `bcstack train sft`.
    manifest.json: counts, the split audit and each file's SHA-256. A duplicate is a problem with the
    same numeric signature (arithmetic: the start and each step's operation and operand; sequence:
    the shown terms), whatever its names and things; duplicates are removed and no signature is in
    two splits. Arithmetic has 1,944 distinct problems and sequence 2,583: train + 64 dev + test
    must fit.
    """
    from rich.console import Console

    from core.kit.cli import fail
    from devkit.toyworld.domains import DomainError, write_domain

    console = Console(stderr=True)
    try:
        manifest = write_domain(out, domain, train=train, test=test, seed=seed, force=force)
    except DomainError as e:
        fail(str(e))  # one unwrapped line: rich would fold a long message across lines
    s = manifest["splits"]
    console.print(
        f"wrote {out}: {domain}, {s['train']:,} train / {s['dev']} dev / {s['test']:,} test prompts "
        f"({manifest['duplicates_removed']:,} duplicates removed)"
    )
