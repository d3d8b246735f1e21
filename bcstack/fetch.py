"""`bcstack checkpoint fetch`: a model from the Hugging Face Hub onto a volume, pinned and verified.

    bcstack checkpoint fetch --repo Qwen/Qwen3-4B --revision <40-hex commit> --out /checkpoints/qwen3-4b

The download is `huggingface_hub.snapshot_download` (its cache, resumable downloads, retries,
`HF_TOKEN`/`--token-env` for gated repositories, `HF_HUB_OFFLINE=1` to use only the cache). Then,
without trusting the transfer: every file is checked against the hash the Hub names its blob by (the
SHA-256 of an LFS file; the git blob SHA-1 of a small file), copied out of the cache as a plain file
into `OUT.partial`, `model_provenance.json` written (repository, commit, files, bytes, library
version, time), `SHA256SUMS` written over all of it (core.checkpoint, the format `bcstack checkpoint
verify` and the engine's loader check) and read back against the copies, and only then renamed to
OUT. Run again on a finished OUT of the same repository and commit, it verifies SHA256SUMS and
stops; a different one is refused unless --force.

A revision must be a full commit hash: a branch such as `main` moves, and the worker would serve
whatever it pointed at on the day the Job ran.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import typer

from core.kit.cli import fail

# core.checkpoint (safetensors, tokenizers) is imported where it is used: `bcstack` must start in
# an image with one service's extra only (tests/test_extras.py), and this module is imported by it.
SUMS_FILE = "SHA256SUMS"  # core.checkpoint.SUMS_FILE; tests/test_checkpoint_fetch.py checks they agree

PROVENANCE_FILE = "model_provenance.json"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class FetchError(Exception):
    """A fetch that cannot go on; the message is one line for the user (never a token)."""


def _blob_ok(path: Path, blob: str) -> bool:
    """Does `path`'s content match the Hub blob name `blob` (SHA-256 for LFS, git SHA-1 otherwise)?"""
    if len(blob) == 64:
        from core.checkpoint import sha256_file

        return sha256_file(path) == blob
    git = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # noqa: S324 - git's own object id
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            git.update(chunk)
    return git.hexdigest() == blob


def _snapshot(
    repo: str, revision: str, token: str | None, cache_dir: Path | None, repo_type: str = "model"
) -> Path:
    """The cached snapshot folder of repo@revision, downloading what is missing."""
    import huggingface_hub
    from huggingface_hub import errors

    try:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id=repo, revision=revision, token=token, cache_dir=cache_dir, repo_type=repo_type
            )
        )
    except errors.GatedRepoError:
        raise FetchError(
            f"{repo} is gated: accept its terms on the Hub and give a token (--token-env)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise FetchError(
            f"{repo}: no such model repository on the Hub (or the token may not read it)"
        ) from None
    except errors.RevisionNotFoundError:
        raise FetchError(f"{repo} has no commit {revision}") from None
    except errors.LocalEntryNotFoundError:
        raise FetchError(
            f"{repo}@{revision} is not in the Hub cache"
            + (
                " and HF_HUB_OFFLINE is set"
                if huggingface_hub.constants.HF_HUB_OFFLINE
                else " and the Hub is unreachable"
            )
        ) from None
    except errors.HfHubHTTPError as exc:
        raise FetchError(f"the Hub refused {repo}@{revision}: {str(exc).splitlines()[0]}") from None


def _cached_files(snapshot: Path) -> list[tuple[str, Path, str | None]]:
    """(relative name, cached path, blob name) for every file of a snapshot; blob None when the
    cache holds a plain file rather than a link into blobs/ (a layout we then cannot check)."""
    files = []
    for path in sorted(snapshot.rglob("*")):
        if path.is_dir():
            continue
        relative = path.relative_to(snapshot)
        if any(part.startswith(".") for part in relative.parts):
            continue  # .gitattributes and the like: not the model
        blob = Path(os.readlink(path)).name if path.is_symlink() else None
        files.append((relative.as_posix(), path, blob))
    return files


def check_source(repo: str, revision: str) -> None:
    """FetchError unless `repo` is OWNER/NAME and `revision` a full commit hash."""
    if not _REPO.match(repo):
        raise FetchError(f"--repo {repo!r}: expected OWNER/NAME, e.g. Qwen/Qwen3-4B")
    if not _COMMIT.match(revision):
        raise FetchError(
            f"--revision {revision!r}: give the full 40-character commit hash (a branch or tag moves; "
            "the Hub page's 'Files and versions' history lists them)"
        )


def checked_snapshot(
    repo: str, revision: str, *, token: str | None, cache_dir: Path | None, repo_type: str = "model"
) -> list[tuple[str, Path, bool]]:
    """(relative name, cached path, checked against the Hub's hash) for every file of repo@revision,
    each file's content checked against its blob name; FetchError on the first that does not match."""
    files = _cached_files(_snapshot(repo, revision, token, cache_dir, repo_type))
    if not files:
        raise FetchError(f"{repo}@{revision}: the snapshot has no files")
    for name, path, blob in files:
        if blob is not None and not _blob_ok(path, blob):
            raise FetchError(
                f"{repo}@{revision}: {name} does not match the Hub's hash {blob[:12]}… (a corrupt cache "
                "entry: delete it from the cache and fetch again)"
            )
    return [(name, path, blob is not None) for name, path, blob in files]


def existing(
    out: Path, repo: str, revision: str, *, provenance_file: str = PROVENANCE_FILE, what: str = "model"
) -> dict[str, Any] | None:
    """The provenance of a finished fetch of repo@revision at `out`, its SHA256SUMS verified; None
    when `out` does not exist. FetchError when it holds something else or fails verification."""
    if not out.exists():
        return None
    try:
        provenance = json.loads((out / provenance_file).read_text())
    except (OSError, ValueError):
        raise FetchError(
            f"{out} exists and is not a fetched {what} (no readable {provenance_file}); "
            "use --force to replace it"
        ) from None
    if (provenance.get("repo"), provenance.get("revision")) != (repo, revision):
        raise FetchError(
            f"{out} holds {provenance.get('repo')}@{provenance.get('revision')}, not {repo}@{revision}; "
            "use --force to replace it"
        )
    verify_sums(out)
    return provenance


def verify_sums(folder: Path) -> int:
    """Every file of `folder` listed in its SHA256SUMS with a matching hash, nothing unlisted; how many."""
    from core.checkpoint import VerifyError, check_hashes

    try:
        sums, unlisted = check_hashes(folder)
    except VerifyError as exc:
        raise FetchError(f"{folder}: {exc}") from None
    if unlisted:
        raise FetchError(f"{folder}: {unlisted[0]} is not in {SUMS_FILE}")
    return len(sums)


def fetch(
    repo: str,
    revision: str,
    out: Path,
    *,
    token: str | None = None,
    cache_dir: Path | None = None,
    force: bool = False,
    progress: Any = None,
) -> dict[str, Any]:
    """Fetch repo@revision into `out` (see the module docstring); the provenance written, with
    `reused` true when `out` already held it verified. `progress(done_bytes, total_bytes, name)`
    is called while copying."""
    check_source(repo, revision)
    out = out.resolve()
    if not force:
        found = existing(out, repo, revision)
        if found is not None:
            return {**found, "reused": True}
    files = checked_snapshot(repo, revision, token=token, cache_dir=cache_dir)
    total = sum(path.stat().st_size for _, path, _ in files)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    done = 0
    for name, path, _ in files:
        target = partial / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)  # follows the cache's link: a plain file on the volume
        done += path.stat().st_size
        if progress is not None:
            progress(done, total, name)
    import huggingface_hub

    provenance = {
        "source": "huggingface",
        "repo": repo,
        "revision": revision,
        "files": len(files),
        "bytes": total,
        "hub_hashes_checked": sum(checked for _, _, checked in files),
        "fetched_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "huggingface_hub": huggingface_hub.__version__,
    }
    (partial / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    from core.checkpoint import write_sha256sums

    write_sha256sums(partial)
    verify_sums(partial)
    if out.exists():
        shutil.rmtree(out)
    os.replace(partial, out)
    return {**provenance, "reused": False}


def command(
    repo: str = typer.Option(
        ..., "--repo", help="The Hub model repository, OWNER/NAME (e.g. Qwen/Qwen3-4B)."
    ),
    revision: str = typer.Option(
        ..., "--revision", help="The full 40-character commit hash to fetch (a branch or tag moves)."
    ),
    out: Path = typer.Option(..., "--out", help="The folder to create, e.g. /checkpoints/qwen3-4b."),
    token_env: str = typer.Option(
        "HF_TOKEN",
        "--token-env",
        help="The environment variable holding the Hub token (gated or private repositories); in the "
        "chart it comes from a Secret. Never printed.",
    ),
    cache_dir: Path | None = typer.Option(
        None,
        "--cache-dir",
        help="The Hub cache to download into and read from (default: huggingface_hub's, HF_HUB_CACHE). "
        "With HF_HUB_OFFLINE=1 only the cache is read.",
        show_default=False,
    ),
    force: bool = typer.Option(False, "--force/--no-force", help="Replace OUT when it holds something else."),
) -> None:
    """Fetch a model from the Hugging Face Hub into OUT, pinned to a commit and verified.

    Each file is checked against the Hub's own hash, copied as a plain file, and covered by
    SHA256SUMS with model_provenance.json beside it; OUT appears only when all of it checks out.
    Rerun on a finished OUT of the same commit, it only verifies.
    """
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    console = Console(stderr=True)
    progress = Progress(
        TextColumn("copying {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=console, transient=True,
    )  # fmt: skip
    task = progress.add_task("", total=None)

    def report(done: int, total: int, name: str) -> None:
        progress.update(task, completed=done, total=total, description=name)

    try:
        with progress:
            result = fetch(
                repo, revision, out, token=os.environ.get(token_env) or None, cache_dir=cache_dir,
                force=force, progress=report,
            )  # fmt: skip
    except FetchError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    verb = "already there, verified" if result["reused"] else "fetched and verified"
    console.print(
        f"{repo}@{revision[:12]}: {verb} at {out} ({result['files']} files, "
        f"{result['bytes'] / 2**30:.2f} GiB; {SUMS_FILE} and {PROVENANCE_FILE} written)"
    )
