"""`bcstack checkpoint fetch`: a model from a Hugging Face Hub cache laid out on disk the way
huggingface_hub lays it out (blobs named by their Hub hash, snapshots/<commit>/ linking to them,
refs/main), read through the real `snapshot_download` with the Hub offline; never a download."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from bcstack.fetch import PROVENANCE_FILE, FetchError, fetch
from core.checkpoint import SUMS_FILE, read_sha256sums, sha256_file

REPO = "Qwen/Qwen3-4B"
COMMIT = "1cfa9a7208912126459214e8b04321603b3df60c"
OTHER_COMMIT = "0" * 40
REPO_ROOT = Path(__file__).resolve().parents[1]
FILES = {
    "config.json": (b'{"architectures": ["Qwen3ForCausalLM"]}\n', False),
    "tokenizer_config.json": (b'{"model_max_length": 40960}\n', False),
    "model-00001-of-00002.safetensors": (os.urandom(300_000), True),
    "model-00002-of-00002.safetensors": (os.urandom(200_000), True),
    "nested/extra.txt": (b"a file in a folder\n", False),
    ".gitattributes": (b"*.safetensors filter=lfs\n", False),
}


def cache_files(repo_dir: Path, commit: str, files: dict[str, tuple[bytes, bool]]) -> None:
    """Lay `files` ({name: (bytes, is LFS)}) into a Hub cache repository folder: LFS files under their
    SHA-256, others under their git blob SHA-1, each snapshots/<commit>/ file a relative link."""
    for name, (data, lfs) in files.items():
        blob = (
            hashlib.sha256(data).hexdigest()
            if lfs
            else hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()  # noqa: S324
        )
        (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "blobs" / blob).write_bytes(data)
        link = repo_dir / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo_dir / "blobs" / blob, link.parent))


def hub_cache(root: Path, commit: str = COMMIT, files: dict = FILES) -> Path:
    """A Hub cache holding REPO@commit: LFS files under their SHA-256, others under their git blob
    SHA-1, each snapshot file a relative link into blobs/ (huggingface_hub's cache layout)."""
    repo_dir = root / ("models--" + REPO.replace("/", "--"))
    cache_files(repo_dir, commit, files)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return root


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_cached_model_is_copied_checked_and_summed(tmp_path, offline):
    cache = hub_cache(tmp_path / "cache")
    out = tmp_path / "checkpoints" / "qwen3-4b"
    seen: list[str] = []
    result = fetch(REPO, COMMIT, out, cache_dir=cache, progress=lambda done, total, name: seen.append(name))
    assert result["reused"] is False and result["files"] == 5 and result["hub_hashes_checked"] == 5
    assert sorted(seen) == sorted(name for name in FILES if not name.startswith("."))
    for name, (data, _) in FILES.items():
        path = out / name
        if name.startswith("."):
            assert not path.exists()
            continue
        assert path.is_file() and not path.is_symlink() and path.read_bytes() == data
    sums = read_sha256sums(out)
    assert set(sums) == {n for n in FILES if not n.startswith(".")} | {PROVENANCE_FILE}
    assert all(sha256_file(out / n) == d for n, d in sums.items())
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    assert provenance["repo"] == REPO and provenance["revision"] == COMMIT
    assert provenance["bytes"] == sum(len(d) for n, (d, _) in FILES.items() if not n.startswith("."))
    assert not out.with_name(out.name + ".partial").exists()
    # Again: the finished folder is verified and kept.
    again = fetch(REPO, COMMIT, out, cache_dir=cache)
    assert again["reused"] is True and again["fetched_at"] == provenance["fetched_at"]


def test_a_corrupt_cache_entry_is_refused_and_nothing_is_left(tmp_path, offline):
    cache = hub_cache(tmp_path / "cache")
    blob = hashlib.sha256(FILES["model-00002-of-00002.safetensors"][0]).hexdigest()
    path = cache / ("models--" + REPO.replace("/", "--")) / "blobs" / blob
    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # flipped: b"x" was no change when it began with x
    out = tmp_path / "out"
    with pytest.raises(FetchError, match=r"model-00002-of-00002.safetensors does not match the Hub's hash"):
        fetch(REPO, COMMIT, out, cache_dir=cache)
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_a_small_file_is_checked_against_its_git_blob_id(tmp_path, offline):
    cache = hub_cache(tmp_path / "cache")
    data = FILES["config.json"][0]
    blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()  # noqa: S324
    (cache / ("models--" + REPO.replace("/", "--")) / "blobs" / blob).write_bytes(
        data.replace(b"Qwen3", b"Llama")
    )
    with pytest.raises(FetchError, match="config.json does not match"):
        fetch(REPO, COMMIT, tmp_path / "out", cache_dir=cache)


def test_the_sums_file_name_is_core_checkpoint_s():
    from bcstack import fetch as fetch_module
    from core import checkpoint

    assert fetch_module.SUMS_FILE == checkpoint.SUMS_FILE


def test_a_moving_revision_or_a_bad_repo_is_refused(tmp_path):
    with pytest.raises(FetchError, match="full 40-character commit hash"):
        fetch(REPO, "main", tmp_path / "out")
    with pytest.raises(FetchError, match="expected OWNER/NAME"):
        fetch("qwen3", COMMIT, tmp_path / "out")


def test_a_commit_not_in_the_cache_offline_is_one_line(tmp_path, offline):
    cache = hub_cache(tmp_path / "cache")
    with pytest.raises(
        FetchError, match=f"{REPO}@{OTHER_COMMIT} is not in the Hub cache and HF_HUB_OFFLINE is set"
    ):
        fetch(REPO, OTHER_COMMIT, tmp_path / "out", cache_dir=cache)


def test_another_model_in_out_needs_force_and_a_tampered_one_is_caught(tmp_path, offline):
    cache = hub_cache(tmp_path / "cache")
    hub_cache(cache, commit=OTHER_COMMIT, files={"config.json": (b"{}\n", False)})
    out = tmp_path / "out"
    fetch(REPO, OTHER_COMMIT, out, cache_dir=cache)
    with pytest.raises(FetchError, match=f"holds {REPO}@{OTHER_COMMIT}, not {REPO}@{COMMIT}; use --force"):
        fetch(REPO, COMMIT, out, cache_dir=cache)
    assert fetch(REPO, COMMIT, out, cache_dir=cache, force=True)["files"] == 5
    (out / "config.json").write_bytes(b"{}\n")
    with pytest.raises(
        FetchError, match=f"config.json: SHA256 mismatch \\(changed since {SUMS_FILE} was written\\)"
    ):
        fetch(REPO, COMMIT, out, cache_dir=cache)
    (tmp_path / "plain").mkdir()
    with pytest.raises(FetchError, match="is not a fetched model"):
        fetch(REPO, COMMIT, tmp_path / "plain", cache_dir=cache)


def test_the_command_offline_with_a_token_that_never_shows(tmp_path):
    cache = hub_cache(tmp_path / "cache")
    out = tmp_path / "ckpt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_TOKEN": "hf_s3cr3tTOKENvalue"}
    args = [sys.executable, "-m", "bcstack", "checkpoint", "fetch", "--repo", REPO, "--revision", COMMIT]
    done = subprocess.run(
        [*args, "--out", str(out)], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "fetched and verified" in done.stderr and (out / SUMS_FILE).is_file()
    again = subprocess.run(
        [*args, "--out", str(out)], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60
    )
    assert again.returncode == 0 and "already there, verified" in again.stderr
    missing = subprocess.run(
        [*args[:-1], OTHER_COMMIT, "--out", str(tmp_path / "x")], capture_output=True, text=True, env=env,
        cwd=REPO_ROOT, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "not in the Hub cache" in missing.stderr
    assert "Traceback" not in missing.stderr
    for run in (done, again, missing):
        assert "hf_s3cr3tTOKENvalue" not in run.stdout + run.stderr


# --- bcstack corpus fetch: a Hub dataset of Parquet rows into corpus.jsonl ---------------------------

DATASET = "Tevatron/browsecomp-plus-corpus"


def dataset_cache(root: Path, shards: list[list[dict]], commit: str = COMMIT) -> Path:
    """The Hub cache of DATASET@commit: Parquet shards (LFS, SHA-256 blobs) and a README (git blob)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    repo_dir = root / ("datasets--" + DATASET.replace("/", "--"))
    files = {"README.md": (b"# corpus\n", False)}
    for i, rows in enumerate(shards):
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buffer)
        files[f"data/train-{i:05d}-of-{len(shards):05d}.parquet"] = (buffer.getvalue(), True)
    cache_files(repo_dir, commit, files)
    return root


DOCS = [
    [{"docid": 1, "text": "---\ntitle: Tartu\n---\nA town.", "url": "https://e/1"}],
    [{"docid": 22, "text": "naïve café ✓", "url": None}, {"docid": 3, "text": "third", "url": "https://e/3"}],
]


def test_a_hub_corpus_becomes_the_index_s_jsonl_verified(tmp_path, offline):
    from bcstack.corpus import CORPUS_FILE, fetch_corpus
    from bcstack.corpus import PROVENANCE_FILE as CORPUS_PROVENANCE
    from services.retrieval.corpus import read_corpus

    cache = dataset_cache(tmp_path / "cache", DOCS)
    out = tmp_path / "corpus"
    result = fetch_corpus(DATASET, COMMIT, out, cache_dir=cache)
    assert result["documents"] == 3 and result["reused"] is False
    rows = [json.loads(line) for line in (out / CORPUS_FILE).read_text(encoding="utf-8").splitlines()]
    assert rows == [
        {"docid": "1", "text": "---\ntitle: Tartu\n---\nA town.", "url": "https://e/1"},
        {"docid": "22", "text": "naïve café ✓", "url": ""},
        {"docid": "3", "text": "third", "url": "https://e/3"},
    ]
    assert [r.doc.docid for r in read_corpus(out / CORPUS_FILE)] == [
        "1",
        "22",
        "3",
    ]  # what `bcstack index` reads
    assert set(read_sha256sums(out)) == {CORPUS_FILE, CORPUS_PROVENANCE}
    assert fetch_corpus(DATASET, COMMIT, out, cache_dir=cache)["reused"] is True
    # A shard whose bytes differ from its Hub hash, a repeated docid: refused, nothing written.
    twice = dataset_cache(tmp_path / "twice", [DOCS[0], DOCS[0]])
    with pytest.raises(FetchError, match="docid '1' appears twice"):
        fetch_corpus(DATASET, COMMIT, tmp_path / "t", cache_dir=twice)
    assert not (tmp_path / "t").exists() and not (tmp_path / "t.partial").exists()
    blobs = cache / ("datasets--" + DATASET.replace("/", "--")) / "blobs"
    shard = max(blobs.iterdir(), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    with pytest.raises(FetchError, match=r"\.parquet does not match the Hub's hash"):
        fetch_corpus(DATASET, COMMIT, tmp_path / "c2", cache_dir=cache)
