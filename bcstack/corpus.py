"""`bcstack corpus fetch`: the BrowseComp-Plus corpus (or any Hub dataset of docid/text/url rows)
into the corpus JSON lines `bcstack index` reads, pinned to a commit and verified.

    bcstack corpus fetch --repo Tevatron/browsecomp-plus-corpus --revision <40-hex commit> --out DIR

The dataset's files come through `huggingface_hub.snapshot_download(repo_type="dataset")` and are
each checked against the Hub's hash, as `bcstack checkpoint fetch` does (bcstack/fetch.py). Its
Parquet files are read batch by batch with the retrieval service's own corpus reader (the rows
`bcstack index` accepts; ~100k documents of ~5k words) into DIR/corpus.jsonl (`docid` as text,
`text`, `url`), with DIR/corpus_provenance.json and SHA256SUMS over both; DIR appears only complete.
The `datasets` library would read the same Parquet files through pyarrow too, but it brings its own
cache (a second copy of the corpus) and a dependency tree the index does not need, and it checks
nothing against the Hub's hashes.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path
from typing import Any

import typer

from bcstack.fetch import SUMS_FILE, FetchError, check_source, checked_snapshot, existing, verify_sums
from core.kit.cli import fail

CORPUS_FILE = "corpus.jsonl"
PROVENANCE_FILE = "corpus_provenance.json"


def fetch_corpus(
    repo: str,
    revision: str,
    out: Path,
    *,
    token: str | None = None,
    cache_dir: Path | None = None,
    force: bool = False,
    progress: Any = None,
) -> dict[str, Any]:
    """Fetch the dataset repo@revision into `out`/corpus.jsonl (module docstring); the provenance,
    with `reused` true when `out` already held it verified. `progress(documents, name)` while writing."""
    # Imported here: `bcstack` starts in images with one service's extra only (tests/test_extras.py).
    from core.checkpoint import write_sha256sums
    from services.retrieval.corpus import CorpusError, read_corpus

    check_source(repo, revision)
    out = out.resolve()
    if not force:
        found = existing(out, repo, revision, provenance_file=PROVENANCE_FILE, what="corpus")
        if found is not None:
            return {**found, "reused": True}
    files = checked_snapshot(repo, revision, token=token, cache_dir=cache_dir, repo_type="dataset")
    parquet = [(name, path) for name, path, _ in files if name.endswith(".parquet")]
    if not parquet:
        raise FetchError(f"{repo}@{revision}: no Parquet files (has {', '.join(n for n, _, _ in files)})")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    seen: set[str] = set()
    try:
        with (partial / CORPUS_FILE).open("w", encoding="utf-8") as handle:
            for name, path in parquet:
                try:
                    # The retrieval service's own reader: the rows `bcstack index` would accept.
                    for number, row in enumerate(read_corpus(path), 1):
                        doc = row.doc
                        if doc.docid in seen:
                            raise FetchError(f"{repo}@{revision}: docid {doc.docid!r} appears twice ({name})")
                        seen.add(doc.docid)
                        document = {"docid": doc.docid, "text": doc.text, "url": doc.url}
                        handle.write(json.dumps(document, ensure_ascii=False) + "\n")
                        if progress is not None and number % 1000 == 0:
                            progress(len(seen), name)
                except CorpusError as exc:
                    message = str(exc).replace(str(path), name)
                    raise FetchError(f"{repo}@{revision}: {message}") from None
        import huggingface_hub

        provenance = {
            "source": "huggingface",
            "repo": repo,
            "repo_type": "dataset",
            "revision": revision,
            "files": [name for name, _ in parquet],
            "documents": len(seen),
            "fetched_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "huggingface_hub": huggingface_hub.__version__,
        }
        (partial / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        write_sha256sums(partial)
        verify_sums(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(partial, out)
    return {**provenance, "reused": False}


app = typer.Typer(help="Retrieval corpora.", no_args_is_help=True)


@app.command("fetch")
def fetch_command(
    repo: str = typer.Option(
        ..., "--repo", help="The Hub dataset, OWNER/NAME (e.g. Tevatron/browsecomp-plus-corpus)."
    ),
    revision: str = typer.Option(..., "--revision", help="The dataset's full 40-character commit hash."),
    out: Path = typer.Option(
        ...,
        "--out",
        help=f"The folder to create: {CORPUS_FILE} (for `bcstack index --corpus`) and its provenance.",
    ),
    token_env: str = typer.Option(
        "HF_TOKEN", "--token-env", help="The environment variable holding a Hub token, if one is needed."
    ),
    cache_dir: Path | None = typer.Option(
        None,
        "--cache-dir",
        help="The Hub cache (default: huggingface_hub's; HF_HUB_OFFLINE=1 reads only it).",
        show_default=False,
    ),  # fmt: skip
    force: bool = typer.Option(False, "--force/--no-force", help="Replace OUT when it holds something else."),
) -> None:
    """Fetch a corpus dataset from the Hugging Face Hub into OUT/corpus.jsonl, pinned and verified.

    Each file is checked against the Hub's hash; the Parquet rows (docid, text, url) become JSON lines;
    SHA256SUMS and corpus_provenance.json sit beside. Rerun on a finished OUT of the same commit, it
    only verifies."""
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("fetching …") as status:

        def report(documents: int, name: str) -> None:
            status.update(f"{name}: {documents:,} documents")

        try:
            result = fetch_corpus(
                repo, revision, out, token=os.environ.get(token_env) or None, cache_dir=cache_dir,
                force=force, progress=report,
            )  # fmt: skip
        except FetchError as exc:
            status.stop()
            fail(str(exc))
        except OSError as exc:
            status.stop()
            fail(f"cannot write {out}: {exc.strerror or exc}")
    verb = "already there, verified" if result["reused"] else "fetched and verified"
    console.print(
        f"{repo}@{revision[:12]}: {verb} at {out / CORPUS_FILE} ({result['documents']:,} documents; "
        f"{SUMS_FILE} and {PROVENANCE_FILE} beside it)"
    )
