"""Canary reload on the local stack (issue 17, item 5): `bcstack worker reload --canary` with a good
and a deliberately broken checkpoint.

The good checkpoint is the tiny model trained until it reproduces an expert episode collected
through the stack (the record holds the exact tokens the worker will see again, so under greedy
decoding it answers that question; one question keeps the suite short, and the decision rules on
more are in test_canary.py). The broken one is the same weights with the token
embedding rows shuffled: it verifies (shapes, dtypes, checksums) and produces garbage. Both stacks
use the session toy kit; the tiny one runs two engine + worker replicas, so the canary has a
replica still on the old version to be compared with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from conftest import wait_until
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from bcstack.cli import app
from bcstack.stack import down, up
from trainer.sft import SFTConfig, train_sft
from trainer.sft_data import SourceSpec, build_mixture, load_record_samples

# This module's stacks fork their services (conftest.forked_services).
pytestmark = pytest.mark.usefixtures("forked_services")

runner = CliRunner()
# Short observations keep the trajectories (and so the training) short; short turns keep a broken
# model's episodes short. Both stacks use the same settings, so the good model sees its training
# context again.
SETTINGS = {"snippet_words": "24", "max_new_tokens_per_turn": "160", "max_turns": "8"}
QUESTIONS = 1


def quiet(_line: str) -> None:
    pass


def assets(kit: Path) -> dict:
    return {"world": kit / "world", "kit": kit / "tiny", "index": kit / "idx"}


@pytest.fixture(scope="module")
def checkpoints(toy_kit, tmp_path_factory) -> dict[str, Path]:
    """{"good", "broken", "questions"}: the two exports and the questions file the good one answers."""
    from transformers import AutoModelForCausalLM

    from trainer.export import export_checkpoint

    root = tmp_path_factory.mktemp("canary")
    kit = toy_kit["dir"]
    easy = [q for q in toy_kit["world"].test if q["data_source"] == "bc_test_easy"][:QUESTIONS]
    questions = root / "questions.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"query_id": q["query_id"], "query": q["query"], "answer": q["answer"]}) + "\n"
            for q in easy
        )
    )
    records = root / "expert-records.sqlite"
    info = up(
        root / "expert",
        worker="expert",
        **assets(kit),
        worker_settings=SETTINGS,
        records=records,
        timeout=60,
        say=quiet,
    )
    try:
        gateway = info["services"]["coordinator"]["http"]
        for q in easy:
            body = httpx.post(
                gateway + "/v1/episodes",
                json={"question": q["query"], "question_id": q["query_id"], "gold_answer": q["answer"]},
                timeout=60,
            ).json()
            assert body["answer"] == q["answer"], body
    finally:
        down(root / "expert", say=quiet)
    samples, counts = load_record_samples(records, source="expert")
    assert counts["samples"] == QUESTIONS, counts
    mixture = build_mixture({"expert": samples}, [SourceSpec("expert", records)])
    config = SFTConfig(
        lr=3e-3,
        min_lr=3e-4,
        warmup_fraction=0.05,
        weight_decay=0.0,
        global_batch=QUESTIONS,
        epochs=120,
        checkpoint_every=10**6,
    )
    train_sft(kit / "tiny", mixture, root / "sft", config=config, say=quiet)
    good = root / "sft" / "serving"

    # Same shapes and dtypes, checksums written by the exporter: only the outputs are garbage.
    model = AutoModelForCausalLM.from_pretrained(good, torch_dtype=torch.float32)
    embeddings = model.get_input_embeddings().weight
    with torch.no_grad():
        embeddings.copy_(
            embeddings[torch.randperm(embeddings.shape[0], generator=torch.Generator().manual_seed(0))]
        )
    model.save_pretrained(root / "shuffled")
    export_checkpoint(root / "shuffled", root / "broken", tokenizer_dir=kit / "tiny")
    return {"good": good, "broken": root / "broken", "questions": questions}


@pytest.fixture(scope="module")
def stack(checkpoints, toy_kit, tmp_path_factory):
    state = tmp_path_factory.mktemp("canary-stack")
    train = state / "train"  # the workers' checkpoint root
    train.mkdir()
    for name, source in (("good", "good"), ("good-v2", "good"), ("broken", "broken")):
        shutil.copytree(checkpoints[source], train / name)
    info = up(
        state,
        worker="tiny",
        **assets(toy_kit["dir"]),
        worker_settings=SETTINGS,
        replicas=2,
        timeout=60,
        say=quiet,
    )
    yield info
    down(state, say=quiet)


def versions(info: dict, token: str) -> list[str]:
    return [
        httpx.get(
            info["services"][name]["http"] + "/admin/reload",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        ).json()["weight_version"]
        for name in ("worker", "worker-2")
    ]


def canary_counts(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.labels["step"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "bcstack_worker_canary_reloads"
        for s in family.samples
        if s.name.endswith("_total")
    }


def test_a_broken_checkpoint_is_rolled_back_and_a_good_one_promoted(
    stack, checkpoints, tmp_path, monkeypatch
):
    state = Path(stack["state"])
    token = (state / "admin-token").read_text().strip()
    monkeypatch.setenv("BCSTACK_ADMIN_TOKEN", token)
    worker1, worker2 = (stack["services"][n]["http"] for n in ("worker", "worker-2"))
    boot = versions(stack, token)
    assert boot[0] == boot[1]

    def reload(checkpoint: str, *extra: str) -> object:
        return runner.invoke(
            app,
            ["worker", "reload", "--checkpoint", str(state / "train" / checkpoint),
             "--workers", f"{worker1},{worker2}", *extra],
        )  # fmt: skip

    judge = stack["services"]["judge"]["http"]
    canary = [
        "--canary", "1", "--eval", str(checkpoints["questions"]), "--judge", judge,
        "--temperature", "0", "--worker-max-tokens", "4000",
    ]  # fmt: skip

    # The boot weights were never reloaded, so there is no folder to roll back to: nothing is touched.
    refused = reload("broken", *canary, "--min-accuracy", "1")
    assert refused.exit_code == 2, refused.output
    assert "no replica touched" in refused.output and "--rollback-checkpoint" in refused.output
    assert versions(stack, token) == boot

    plain = reload("good")
    assert plain.exit_code == 0, plain.output
    assert versions(stack, token) == ["good", "good"]

    # Broken weights on the first replica: answered 0/1 against the second replica's 1/1 at the
    # same time, a drop over 0 pp, so the canary goes back to "good".
    report = tmp_path / "broken.json"
    failed = reload("broken", *canary, "--max-drop", "0", "--report", str(report))
    assert failed.exit_code == 1, failed.output
    assert "FAIL" in failed.output and "canary rolled back" in failed.output
    assert versions(stack, token) == ["good", "good"]
    result = json.loads(report.read_text())
    assert result["decision"] == "rolled back"
    assert (result["canary"]["version"], result["canary"]["correct"]) == ("broken", 0)
    assert (result["baseline"]["version"], result["baseline"]["correct"]) == ("good", QUESTIONS)
    assert result["canary"]["turn_weight_versions"].keys() == {"broken"}
    assert result["baseline"]["turn_weight_versions"].keys() == {"good"}
    assert [(s["step"], s["replica"], s["state"]) for s in result["steps"]] == [
        ("canary", worker1, "reloaded"),
        ("rollback", worker1, "reloaded"),
    ]
    assert result["plan"]["rollback_checkpoint"] == str((state / "train" / "good").resolve())
    counted = canary_counts(worker1)
    assert counted[("canary", "ok")] == 1 and counted[("rollback", "ok")] == 1
    assert counted[("promote", "ok")] == 0

    # The good weights under a new name pass the accuracy bar on the canary and reach both replicas.
    promoted = reload("good-v2", *canary, "--min-accuracy", "1")
    assert promoted.exit_code == 0, promoted.output
    assert "PASS" in promoted.output and "canary promoted" in promoted.output
    wait_until(lambda: versions(stack, token) == ["good-v2", "good-v2"], timeout=10, message="both promoted")
    assert canary_counts(worker1)[("canary", "ok")] == 2
    assert canary_counts(worker2)[("promote", "ok")] == 1
