"""The trained tiny worker `make demo` hot-reloads (demo/trained-tiny, bcstack.demo_checkpoint): the
committed checkpoint verifies, its provenance is the committed results file of a clean speedrun
run, the untrained kit the demo starts from has its shape and tokenizer, and packaging refuses what
it must."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bcstack import demo_checkpoint
from bcstack.demo_checkpoint import DemoCheckpointError, build_untrained_kit, load, package
from core.checkpoint import verify_checkpoint

REPO = Path(__file__).resolve().parent.parent


def test_the_committed_checkpoint_comes_from_a_committed_clean_final_run() -> None:
    trained = load()
    results = json.loads((REPO / trained.provenance["results_file"]).read_text())
    assert results["uncommitted_changes"] == [] and results["machine"]["worktree"] == "clean"
    assert results["split"] == "test", "the demo's checkpoint is a final run's (its recipe chosen on dev)"
    for key in ("commit", "world_seed", "train_seed", "rl_updates", "date", "command"):
        assert trained.provenance[key] == results[key], key
    assert Path(results["rl_model"]).name == trained.provenance["export"]
    assert [(s["name"], s["correct"], s["total"]) for s in trained.provenance["stages"]] == [
        (s["name"], s["correct"], s["total"]) for s in results["stages"]
    ]
    assert trained.worker_settings == results["settings"]["worker"]
    assert trained.budget == results["settings"]["budget"]
    # It learnt something on its own world's held-out questions (the demo shows it on another world).
    by_name = {s["name"]: s["correct"] for s in trained.provenance["stages"]}
    assert by_name["SFT + RL"] > by_name["Untrained tiny"] and by_name["SFT"] > by_name["Untrained tiny"]


def test_the_untrained_kit_has_the_checkpoints_shape_and_tokenizer(tmp_path: Path) -> None:
    trained = load()
    kit = build_untrained_kit(trained, tmp_path / "kit")
    # The engine's compatibility check of a reload: the architecture fields equal.
    verify_checkpoint(trained.folder, expect_config=kit)
    for name in demo_checkpoint.TOKENIZER_FILES:
        assert (kit / name).read_bytes() == (trained.folder / name).read_bytes()
    # A kit built another way (Qwen3's single digits) is refused before anything starts.
    (kit / "tokenizer.json").write_text((kit / "tokenizer.json").read_text().replace('"', "'", 1))
    with pytest.raises(DemoCheckpointError, match="keeps the served tokenizer"):
        build_untrained_kit(trained, kit)


def test_a_touched_checkpoint_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "trained-tiny"
    shutil.copytree(demo_checkpoint.DEMO_CHECKPOINT, root)
    weights = root / "checkpoint" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(DemoCheckpointError, match="fails verification.*model.safetensors"):
        load(root)
    shutil.copytree(demo_checkpoint.DEMO_CHECKPOINT, tmp_path / "second")
    provenance = json.loads((tmp_path / "second" / "provenance.json").read_text())
    del provenance["budget"]
    (tmp_path / "second" / "provenance.json").write_text(json.dumps(provenance))
    with pytest.raises(DemoCheckpointError, match="lacks budget"):
        load(tmp_path / "second")


def _results(tmp_path: Path, **changes) -> Path:
    """A results file like bench/speedrun.py's, its RL export in a moved state folder under tmp_path."""
    trained = load()
    run = json.loads((REPO / trained.provenance["results_file"]).read_text())
    export = tmp_path / "moved" / "stack" / "train" / "rl" / "exports" / "u000007"
    shutil.copytree(trained.folder, export)
    run.update(rl_model=f"/gone/state/stack/train/rl/exports/{export.name}", rl_updates=7, **changes)
    path = tmp_path / "speedrun-w9-t9-test.json"
    path.write_text(json.dumps(run))
    return path


def test_package_copies_the_export_with_its_provenance(tmp_path: Path, capsys) -> None:
    results = _results(tmp_path)
    out = tmp_path / "out"
    assert (
        demo_checkpoint.main(
            ["--results", str(results), "--state", str(tmp_path / "moved"), "--out", str(out)]
        )
        == 0
    )
    made = load(out)
    assert made.provenance["rl_updates"] == 7 and made.provenance["export"] == "u000007"
    assert made.provenance["results_file"] == str(results)
    assert (out / "checkpoint" / "SHA256SUMS").read_bytes() == (load().folder / "SHA256SUMS").read_bytes()
    assert "SHA256SUMS verified" in capsys.readouterr().out
    # The export where the results file says (the state folder has moved): a clear error, exit 2.
    assert demo_checkpoint.main(["--results", str(results), "--out", str(tmp_path / "x")]) == 2
    assert "/gone/state/stack/train/rl/exports/u000007" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"uncommitted_changes": [" M bcstack/speedrun.py"]}, "dirty tree"),
        ({"rl_updates": 0}, "no RL update"),
    ],
)
def test_package_refuses_a_dirty_or_untrained_run(tmp_path: Path, changes: dict, message: str) -> None:
    results = _results(tmp_path)
    run = json.loads(results.read_text())
    run.update(changes)
    results.write_text(json.dumps(run))
    with pytest.raises(DemoCheckpointError, match=message):
        package(results, tmp_path / "moved", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_package_refuses_a_file_that_is_not_a_speedrun_result(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(DemoCheckpointError, match="not a bench/speedrun.py results file"):
        package(path, None, tmp_path / "out")
    path.write_text("{")
    with pytest.raises(DemoCheckpointError, match="not readable JSON"):
        package(path, None, tmp_path / "out")
