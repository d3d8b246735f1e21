"""The RL run's metrics sinks (trainer/sinks.py) and `bcstack train report` (bcstack/rl/report.py).

Each sink is read back the way a user would see it: metrics.jsonl line by line, TensorBoard's own
event reader, a Prometheus scrape over HTTP, the bytes of an offline wandb run, the PNG as an image.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import LOOPBACK, find_free_port, wait_until
from prometheus_client.parser import text_string_to_metric_families
from scipy.stats import binomtest

from trainer.sinks import (
    COUNTERS,
    GAUGES,
    METRIC_PREFIX,
    MetricsFileError,
    RunSinks,
    SinkError,
    read_metrics,
    trim_metrics,
)

ROOT = Path(__file__).resolve().parents[1]


def update_metrics(update: int) -> dict:
    """A metrics dict shaped like the loop's, with values that differ per update."""
    return {
        "update": update,
        "weight_version": f"rl-u{update}",
        "reward_mean": 0.125 * update,
        "accuracy": 0.25 * update,
        "graded_episodes": 16,
        "kl": 0.001 * update,
        "policy_lag_max": update - 1,
        "policy_lag_mean": (update - 1) / 2,
        "policy_lag_hist": {"0": 5, "1": 3 * update},
        "rollout_tokens_per_s": 1000.0 * update,
        "train_tokens_per_s": 500.0 * update,
        "reload_seconds": 2.5,
        "export_seconds": 1.5 * update,
        "dropped_stale": update,
        "excluded_episodes": 2,
        "zero_variance_groups": 3 * update,
        "mixed_versions": False,
        "loss": 2.0 / update,
        "lr": 1e-6,
    }


def file_lines(out: Path) -> list[str]:
    return (out / "metrics.jsonl").read_text().splitlines()


# --- metrics.jsonl ------------------------------------------------------------------------------


def test_each_log_call_appends_one_strict_json_line(tmp_path):
    with RunSinks(tmp_path, set()) as sinks:
        sinks.log(1, {"update": 1, "kl": float("nan"), "loss": np.float32(0.5), "steps": np.int64(3)})
        assert len(file_lines(tmp_path)) == 1  # on disk before the run ends
        sinks.log(2, {"update": 2, "kl": 0.25, "hist": {"0": 4}})
    lines = file_lines(tmp_path)
    assert [json.loads(line) for line in lines] == [
        {"update": 1, "kl": None, "loss": 0.5, "steps": 3},
        {"update": 2, "kl": 0.25, "hist": {"0": 4}},
    ]
    assert "NaN" not in lines[0]
    assert read_metrics(tmp_path) == [json.loads(line) for line in lines]


def test_the_update_argument_and_the_dict_must_agree(tmp_path):
    with RunSinks(tmp_path, set()) as sinks, pytest.raises(ValueError, match="update 2"):
        sinks.log(3, {"update": 2})


def test_read_metrics_ignores_a_torn_last_line_and_the_next_run_appends_cleanly(tmp_path):
    good = [json.dumps(update_metrics(u)) for u in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(good) + '\n{"update": 3, "reward_me')
    assert [r["update"] for r in read_metrics(tmp_path)] == [1, 2]
    with RunSinks(tmp_path, set()) as sinks:
        sinks.log(3, update_metrics(3))
    assert [json.loads(line)["update"] for line in file_lines(tmp_path)] == [1, 2, 3]


def test_a_complete_last_line_without_its_newline_is_kept(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"update": 1, "kl": 0.5}))
    assert read_metrics(tmp_path) == [{"update": 1, "kl": 0.5}]
    with RunSinks(tmp_path, set()) as sinks:
        sinks.log(2, {"kl": 0.25})
    assert [r["update"] for r in read_metrics(tmp_path)] == [1, 2]


def test_a_bad_line_in_the_middle_is_an_error_naming_the_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"update": 1}\n{"upd\n{"update": 3}\n')
    with pytest.raises(MetricsFileError, match=r"metrics\.jsonl:2"):
        read_metrics(tmp_path)


def test_read_metrics_of_a_folder_without_the_file_is_empty(tmp_path):
    assert read_metrics(tmp_path) == []


def test_trim_keeps_the_updates_up_to_the_given_one(tmp_path):
    with RunSinks(tmp_path, set()) as sinks:
        for u in range(1, 6):
            sinks.log(u, update_metrics(u))
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"update": 6, "rew')  # a crash mid-write, then a resume from update 3
    assert trim_metrics(tmp_path, 3) == 3
    assert [r["update"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert all(json.loads(line) for line in file_lines(tmp_path))
    assert trim_metrics(tmp_path / "nothing-here", 3) == 0


def test_unknown_report_to_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown report_to mlflow; valid: tensorboard, wandb"):
        RunSinks(tmp_path, {"mlflow", "tensorboard"})


# --- TensorBoard ----------------------------------------------------------------------------------


def tensorboard_scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_every_numeric_value(tmp_path):
    with RunSinks(tmp_path, {"tensorboard"}, config={"lr": 1e-6}) as sinks:
        for u in (1, 2):
            sinks.log(u, update_metrics(u))
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["reward_mean"] == [(1, 0.125), (2, 0.25)]
    assert scalars["policy_lag_hist/1"] == [(1, 3.0), (2, 6.0)]
    assert scalars["policy_lag_hist/0"] == [(1, 5.0), (2, 5.0)]
    assert scalars["export_seconds"] == [(1, 1.5), (2, 3.0)]
    numeric = {
        k for k, v in update_metrics(1).items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    assert set(scalars) == (numeric - {"update"}) | {"policy_lag_hist/0", "policy_lag_hist/1"}


def test_a_resumed_run_replaces_the_later_tensorboard_points(tmp_path):
    with RunSinks(tmp_path, {"tensorboard"}) as sinks:
        for u in (1, 2, 3):
            sinks.log(u, {"reward_mean": float(u)})
    with RunSinks(tmp_path, {"tensorboard"}, resume_update=1) as sinks:
        sinks.log(2, {"reward_mean": 20.0})
    assert tensorboard_scalars(tmp_path)["reward_mean"] == [(1, 1.0), (2, 20.0)]
    assert [(r["update"], r["reward_mean"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 20.0)]


# --- Prometheus -----------------------------------------------------------------------------------


def scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://{LOOPBACK}:{port}/metrics", timeout=5).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(METRIC_PREFIX) and not sample.name.endswith("_created")
    }


def test_prometheus_serves_the_last_gauges_and_the_summed_counters(tmp_path):
    port = find_free_port()
    started = time.time()
    sinks = RunSinks(tmp_path, set(), prometheus_port=port, prometheus_host=LOOPBACK)
    try:
        before_update = scrape(port)["bcstack_trainer_last_update_timestamp_seconds"]
        time.sleep(0.05)
        sinks.log(1, update_metrics(1))
        sinks.log(2, {**update_metrics(2), "kl": None})  # a missing value keeps the gauge
        seen = scrape(port)
    finally:
        sinks.close()
    # The stalled-trainer alert's clock: the start before the first update, then each update.
    assert started <= before_update < seen.pop("bcstack_trainer_last_update_timestamp_seconds") <= time.time()
    last = update_metrics(2)
    assert seen == {
        "bcstack_trainer_update": 2,
        "bcstack_trainer_reward_mean": last["reward_mean"],
        "bcstack_trainer_accuracy": last["accuracy"],
        "bcstack_trainer_kl": update_metrics(1)["kl"],
        "bcstack_trainer_policy_lag_max": last["policy_lag_max"],
        "bcstack_trainer_rollout_tokens_per_second": last["rollout_tokens_per_s"],
        "bcstack_trainer_train_tokens_per_second": last["train_tokens_per_s"],
        "bcstack_trainer_reload_seconds": last["reload_seconds"],
        "bcstack_trainer_export_seconds": last["export_seconds"],
        "bcstack_trainer_loss": last["loss"],
        "bcstack_trainer_learning_rate": last["lr"],
        "bcstack_trainer_dropped_stale_total": 1 + 2,
        "bcstack_trainer_excluded_episodes_total": 2 + 2,
        "bcstack_trainer_zero_variance_groups_total": 3 + 6,
    }
    assert len(seen) == len(GAUGES) + len(COUNTERS)
    assert not any(":" in name for name in seen)
    with pytest.raises(httpx.TransportError):  # closed with the run
        httpx.get(f"http://{LOOPBACK}:{port}/metrics", timeout=2)


def test_a_port_in_use_is_a_sink_error_naming_it(tmp_path):
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SinkError, match=f"{LOOPBACK}:{port}"):
            RunSinks(tmp_path, set(), prometheus_port=port, prometheus_host=LOOPBACK)


# --- Weights & Biases -----------------------------------------------------------------------------


def test_wandb_offline_run_records_the_scalars_and_the_config(tmp_path, monkeypatch):
    for var, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }.items():
        monkeypatch.setenv(var, value)
    out = tmp_path / "out"
    with RunSinks(out, {"wandb"}, run_name="rl-test", config={"learning_rate": 3e-6}) as sinks:
        sinks.log(1, {**update_metrics(1), "reward_mean": 0.4375})
        sinks.log(2, update_metrics(2))
    (run_file,) = (out / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    needles = (b"reward_mean", b"0.4375", b"policy_lag_hist/1", b"learning_rate", b"rl-test")
    # wandb's own service process writes the offline file; under load its last records can reach the
    # disk a moment after finish() returns (seen: the 7-byte header alone, 1 run in 3 here), so the
    # file is read until they are there, for at most 20 s: data that never lands still fails.
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: all(n in run_file.read_bytes() for n in needles), timeout=20, interval=0.2)
    data = run_file.read_bytes()
    for needle in needles:
        assert needle in data, needle
    assert [r["update"] for r in read_metrics(out)] == [1, 2]


def test_wandb_not_installed_is_a_clear_error_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(SinkError, match=r"^pip install wandb to use --report-to wandb$"):
        RunSinks(tmp_path / "out", {"wandb"})
    assert not (tmp_path / "out").exists()


# --- bcstack train report -------------------------------------------------------------------------


def bcstack(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bcstack", *args], capture_output=True, text=True, cwd=ROOT)


def table(markdown: str, header: str) -> dict[str, list[str]]:
    """The rows of the Markdown table under ``header`` as {first cell: other cells}."""
    lines = markdown[markdown.index(header) :].splitlines()[2:]
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_report_writes_a_png_and_a_summary_computed_from_the_metrics(tmp_path):
    import matplotlib.image

    records = []
    for u in range(1, 9):
        m = update_metrics(u) | {"accuracy": [0.25, 0.3125, 0.375, 0.375, 0.4375, 0.5, 0.5, 0.5625][u - 1]}
        if u % 4 == 0:
            m |= {
                "eval_accuracy": 0.1 * u,
                "eval_wilson_low": 0.1 * u - 0.05,
                "eval_wilson_high": 0.1 * u + 0.07,
            }
        records.append(m)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    result = bcstack("train", "report", str(tmp_path))
    assert result.returncode == 0, result.stderr
    png, md = tmp_path / "report.png", tmp_path / "report.md"
    assert str(png) in result.stdout and str(md) in result.stdout
    image = matplotlib.image.imread(png)
    assert image.shape[0] >= 600 and image.shape[1] >= 900 and image.std() > 0

    text = md.read_text()
    assert "8 updates (1 to 8)" in text
    rows = table(text, "| metric |")
    for key in ("reward_mean", "accuracy", "kl", "policy_lag_max", "export_seconds"):
        values = [r[key] for r in records]
        first, last, mean, low, high = (float(c) for c in rows[key])
        expected = (values[0], values[-1], sum(values) / len(values), min(values), max(values))
        assert (first, last, mean, low, high) == pytest.approx(expected, rel=1e-3), key
    assert float(rows["eval_accuracy"][1]) == pytest.approx(0.8)

    totals = table(text, "| count |")
    for key in ("dropped_stale", "excluded_episodes", "zero_variance_groups", "graded_episodes"):
        assert int(totals[key][0]) == sum(r[key] for r in records), key

    # The last update's accuracy with its Wilson 95% interval: 9 of 16 graded episodes.
    m = re.search(
        r"Accuracy at update 8: ([\d.]+) over 16 graded episodes \(Wilson 95%: ([\d.]+) to ([\d.]+)\)", text
    )
    assert m is not None, text
    ci = binomtest(9, 16).proportion_ci(method="wilson")
    assert float(m[1]) == 0.5625
    assert (float(m[2]), float(m[3])) == pytest.approx((ci.low, ci.high), rel=1e-3)
    assert re.search(r"Held-out accuracy at update 8: 0\.8 \(Wilson 95%: 0\.75 to 0\.87\)", text), text


def test_report_on_a_folder_without_metrics_exits_1_with_one_line(tmp_path):
    result = bcstack("train", "report", str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert "metrics.jsonl" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "report.png").exists()


def test_report_counts_a_repeated_update_once_with_its_last_line(tmp_path):
    from bcstack.rl.report import load_updates, summarise

    lines = [{"update": 1, "kl": 1.0}, {"update": 2, "kl": 2.0}, {"update": 2, "kl": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = load_updates(tmp_path)
    assert [r["kl"] for r in records] == [1.0, 4.0]
    assert math.isclose(summarise(records, "kl").mean, 2.5)
