"""Where a training run (`bcstack train rl`, `bcstack train sft`) sends its metrics: OUT/metrics.jsonl,
always, and optionally TensorBoard, Weights & Biases and a Prometheus endpoint.

`RunSinks(out, report_to, prometheus_port=...)` is opened once per run; `.log(update, metrics)`
after every update fans one metrics dict out to every sink:

- ``OUT/metrics.jsonl``: one JSON object per call, fsynced, with ``update`` in it. Values that are
  not finite (NaN, inf) are written as null, so the file is strict JSON for jq and pandas.
  `read_metrics` reads it back, ignoring a torn last line (a crash mid-write); `trim_metrics`
  keeps the lines up to an update (on resume, so no update is counted twice).
- ``tensorboard``: event files under OUT/tensorboard (torch's SummaryWriter), one scalar per
  numeric value, nested dicts flattened with "/" (a lag histogram ``{"policy_lag_hist": {"0": 5}}``
  becomes ``policy_lag_hist/0``), at step ``update``; the run config as text.
- ``wandb``: the same scalars to a Weights & Biases run in OUT/wandb (``pip install wandb``; it
  is imported only when asked for). ``WANDB_MODE=offline`` logs with no network and no account;
  ``wandb sync OUT/wandb/wandb/offline-run-*`` uploads later. WANDB_PROJECT and WANDB_ENTITY are
  read by wandb itself.
- Prometheus (``prometheus_port``): the run's own registry on HOST:PORT/metrics, for the pod's
  scrape; the newest value of each gauge, and counters summed over the updates of this process:

  ========================================== ===================================================
  metric                                     from the metrics key
  ========================================== ===================================================
  bcstack_trainer_update                     ``update`` (the last finished update)
  bcstack_trainer_reward_mean                ``reward_mean``
  bcstack_trainer_accuracy                   ``accuracy`` (fraction of graded episodes correct)
  bcstack_trainer_kl                         ``kl`` (k3 estimate to the reference, nats/token)
  bcstack_trainer_policy_lag_max             ``policy_lag_max`` (policy versions)
  bcstack_trainer_rollout_tokens_per_second  ``rollout_tokens_per_s`` or ``..._per_second``
  bcstack_trainer_train_tokens_per_second    ``train_tokens_per_s`` or ``..._per_second``
  bcstack_trainer_reload_seconds             ``reload_seconds``
  bcstack_trainer_export_seconds             ``export_seconds``
  bcstack_trainer_loss                       ``loss`` (SFT's token-mean cross-entropy)
  bcstack_trainer_learning_rate              ``lr``
  bcstack_trainer_last_update_timestamp_seconds  Unix time of the last ``log`` (the sink's start
                                             before the first): what the stalled-trainer alert reads
  bcstack_trainer_dropped_stale_total        counter, ``dropped_stale`` per update
  bcstack_trainer_excluded_episodes_total    counter, ``excluded_episodes`` per update
  bcstack_trainer_zero_variance_groups_total counter, ``zero_variance_groups`` per update
  ========================================== ===================================================

  A key missing from an update leaves its gauge at the previous value. Counters restart at 0 with
  the process (a resumed run), which Prometheus' rate() reads as a counter reset.

Construction fails with `SinkError` (a ValueError) naming what to do: an unknown report_to name,
wandb not installed or not logged in, a port in use.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
REPORT_TO = frozenset({"tensorboard", "wandb"})
METRIC_PREFIX = "bcstack_trainer_"

# Prometheus gauge (name after the prefix) -> (help, metrics keys, the first one present is used).
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "update": ("The last finished RL update.", ("update",)),
    "reward_mean": ("Mean reward of the graded episodes of the last update.", ("reward_mean",)),
    "accuracy": ("Fraction of the last update's graded episodes judged correct.", ("accuracy",)),
    "kl": ("KL estimate (k3) of the policy to the reference in the last update.", ("kl",)),
    "policy_lag_max": (
        "Largest policy lag (versions) of a group trained on in the last update.",
        ("policy_lag_max",),
    ),
    "rollout_tokens_per_second": (
        "Rollout tokens generated per second since the previous update.",
        ("rollout_tokens_per_s", "rollout_tokens_per_second"),
    ),
    "train_tokens_per_second": (
        "Tokens trained on per second in the last update's GRPO step.",
        ("train_tokens_per_s", "train_tokens_per_second"),
    ),
    "reload_seconds": ("Seconds the last rolling reload of the workers took.", ("reload_seconds",)),
    "export_seconds": ("Seconds the last serving-format export took.", ("export_seconds",)),
    "loss": ("Training loss of the last update (SFT: token-mean cross-entropy).", ("loss",)),
    "learning_rate": ("Learning rate of the last update.", ("lr",)),
}
# Prometheus counter (name after the prefix, before `_total`) -> (help, the per-update count key).
COUNTERS: dict[str, tuple[str, str]] = {
    "dropped_stale": ("Groups dropped for exceeding the policy-lag bound.", "dropped_stale"),
    "excluded_episodes": ("Episodes excluded because the judge could not grade them.", "excluded_episodes"),
    "zero_variance_groups": (
        "Groups whose episodes all had the same reward (no GRPO signal).",
        "zero_variance_groups",
    ),
}


class SinkError(ValueError):
    """A sink that cannot work as asked; the message says what to do."""


class MetricsFileError(ValueError):
    """A malformed line in the middle of a metrics.jsonl; the message names the file and line."""


# --- metrics.jsonl ------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """numpy and torch scalars as Python numbers, dicts recursively; other values as they are."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def _strict_json(value: Any) -> Any:
    """NaN and infinities as None: JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(v) for v in value]
    return value


def _scan(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a metrics.jsonl and the byte length of the part they fill.

    The last non-blank line may be torn (a crash mid-write): if it does not parse it is left out
    and the length stops before it. A bad line followed by good ones raises MetricsFileError.
    """
    data = path.read_bytes()
    lines = data.split(b"\n")
    records: list[dict[str, Any]] = []
    good_end = pos = 0
    for i, raw in enumerate(lines):
        end = pos + len(raw) + (1 if i < len(lines) - 1 else 0)
        if raw.strip():
            try:
                record = json.loads(raw)
                if not isinstance(record, dict) or not isinstance(record.get("update"), int):
                    raise ValueError("not a JSON object with an integer `update`")
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                if any(rest.strip() for rest in lines[i + 1 :]):
                    raise MetricsFileError(f"{path}:{i + 1}: {e}") from None
                break
            records.append(record)
            good_end = end
        pos = end
    return records, good_end


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    """Every record of OUT/metrics.jsonl in file order (empty when there is no file)."""
    path = Path(out_dir) / METRICS_FILE
    return _scan(path)[0] if path.is_file() else []


def _write_lines(path: Path, records: Iterable[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(_strict_json(r), allow_nan=False) + "\n" for r in records)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def trim_metrics(out_dir: Path, update: int) -> int:
    """Keep only the records of OUT/metrics.jsonl with ``update <= update`` (atomically, so a crash
    leaves the old file or the new one); returns how many are kept. A torn last line goes too."""
    path = Path(out_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    kept = [r for r in _scan(path)[0] if r["update"] <= update]
    _write_lines(path, kept)
    return len(kept)


def _repair_tail(path: Path) -> None:
    """Cut a torn last line before appending, so the next record starts on a line of its own."""
    if not path.is_file():
        return
    _records, good_end = _scan(path)
    size = path.stat().st_size
    with path.open("r+b") as handle:
        if good_end < size:
            handle.truncate(good_end)
        if good_end > 0:
            handle.seek(good_end - 1)
            if handle.read(1) != b"\n":
                handle.write(b"\n")


# --- scalars for TensorBoard and wandb ----------------------------------------------------------


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every numeric value as (tag, float); dicts flattened to ``key/subkey``; booleans, None,
    strings and lists left out."""
    for key, value in metrics.items():
        tag = f"{prefix}{key}"
        value = _plain(value)
        if isinstance(value, Mapping):
            yield from scalars(value, prefix=f"{tag}/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield tag, float(value)


# --- the sinks ----------------------------------------------------------------------------------


class _Prometheus:
    def __init__(self, port: int, host: str, run_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry(auto_describe=True)
        self.gauges = {
            keys: Gauge(METRIC_PREFIX + name, text, registry=self.registry)
            for name, (text, keys) in GAUGES.items()
        }
        self.counters = {
            key: Counter(METRIC_PREFIX + name, text, registry=self.registry)
            for name, (text, key) in COUNTERS.items()
        }
        self.last_update = Gauge(
            METRIC_PREFIX + "last_update_timestamp_seconds",
            "Unix time of the last finished update (the run's start before the first).",
            registry=self.registry,
        )
        self.last_update.set_to_current_time()
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise SinkError(f"cannot serve Prometheus metrics for {run_name} on {host}:{port}: {e}") from e

    def log(self, metrics: Mapping[str, Any]) -> None:
        self.last_update.set_to_current_time()
        for keys, gauge in self.gauges.items():
            value = next((metrics[k] for k in keys if metrics.get(k) is not None), None)
            if isinstance(value, int | float) and not isinstance(value, bool):
                gauge.set(value)
        for key, counter in self.counters.items():
            value = metrics.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                counter.inc(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise SinkError("pip install wandb to use --report-to wandb") from None
    return wandb


class RunSinks:
    """One run's metrics sinks; see the module docstring. Use as a context manager or call close().

    ``resume_update``: the run resumes after this update; metrics.jsonl is trimmed to it and
    TensorBoard is told to drop the later points an earlier process wrote, so each update is
    plotted once.
    """

    def __init__(
        self,
        out_dir: Path,
        report_to: set[str] | frozenset[str],
        *,
        prometheus_port: int | None = None,
        prometheus_host: str = "0.0.0.0",
        run_name: str = "rl",
        config: dict[str, Any] | None = None,
        resume_update: int | None = None,
        wandb_project: str | None = None,
    ) -> None:
        unknown = set(report_to) - REPORT_TO
        if unknown:
            raise SinkError(
                f"unknown report_to {', '.join(sorted(unknown))}; valid: {', '.join(sorted(REPORT_TO))}"
            )
        wandb = _import_wandb() if "wandb" in report_to else None
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS_FILE
        if resume_update is not None:
            trim_metrics(self.out_dir, resume_update)
        _repair_tail(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        self._tensorboard: Any = None
        self._prometheus: _Prometheus | None = None
        self._wandb_run: Any = None
        self._closed = False
        try:
            if "tensorboard" in report_to:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(
                    log_dir=str(self.out_dir / TENSORBOARD_DIR),
                    purge_step=None if resume_update is None else resume_update + 1,
                )
                if config:
                    text = json.dumps(_plain(config), indent=2, sort_keys=True, default=str)
                    self._tensorboard.add_text("config", f"```json\n{text}\n```", global_step=resume_update)
            if prometheus_port is not None:
                self._prometheus = _Prometheus(prometheus_port, prometheus_host, run_name)
            if wandb is not None:
                (self.out_dir / WANDB_DIR).mkdir(exist_ok=True)
                try:
                    self._wandb_run = wandb.init(
                        dir=str(self.out_dir / WANDB_DIR),
                        name=run_name,
                        project=wandb_project,
                        config=_plain(config or {}),
                    )
                except wandb.errors.Error as e:
                    raise SinkError(
                        f"wandb: {e} (or set WANDB_MODE=offline to log to {self.out_dir / WANDB_DIR} "
                        "with no account)"
                    ) from e
        except BaseException:
            self.close()
            raise

    def log(self, update: int, metrics: Mapping[str, Any]) -> None:
        """Send one update's metrics to every sink; the metrics.jsonl line is on disk on return."""
        record = _plain({"update": update, **metrics})
        if record["update"] != update:
            raise ValueError(f"metrics say update {record['update']}, the call says {update}")
        self._file.write(json.dumps(_strict_json(record), allow_nan=False, default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        values = dict(scalars({k: v for k, v in record.items() if k != "update"}))
        if self._tensorboard is not None:
            for tag, value in values.items():
                self._tensorboard.add_scalar(tag, value, global_step=update)
            self._tensorboard.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=update)
        if self._prometheus is not None:
            self._prometheus.log(record)

    def close(self) -> None:
        """Flush and close every sink (idempotent); the Prometheus endpoint stops."""
        if self._closed:
            return
        self._closed = True
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._prometheus is not None:
            self._prometheus.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()

    def __enter__(self) -> RunSinks:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
