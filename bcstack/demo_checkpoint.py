"""The trained tiny worker the demo hot-reloads: packaged from a `make speedrun`, checked before use.

`make demo` shows a trained worker beside the untrained one without training one (training takes
the speedrun's ~40 minutes). The checkpoint it reloads is the RL model of one committed speedrun
run, copied verbatim into `demo/trained-tiny/checkpoint/` (its export's SHA256SUMS included, a few
MB) with `demo/trained-tiny/provenance.json` beside it: the run's results file, commit, machine,
date, world and training seeds, its held-out accuracy per stage, and what the demo needs to serve
it as it was trained (the model shape, the tokenizer's digit grouping, the worker settings and
budget).

The CPU engine, like SGLang's `/update_weights_from_disk`, swaps weights and keeps the served
tokenizer, so the untrained model the demo starts with is a kit of the same shape and tokenizer
(`build_untrained_kit`); `load` and the demo check that the tokenizer files agree byte for byte.

    python -m bcstack.demo_checkpoint --results bench/results/speedrun-w1-t0-test.json \\
        --state /path/to/the/speedrun/state

packages a finished run (its state folder still holding the RL export the results file names).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.checkpoint import SUMS_FILE, VerifyError, verify_checkpoint

REPO = Path(__file__).resolve().parent.parent
DEMO_CHECKPOINT = REPO / "demo" / "trained-tiny"
PROVENANCE = "provenance.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SHAPE_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size",
)  # fmt: skip


class DemoCheckpointError(Exception):
    """The packaged checkpoint or its provenance is missing, incomplete or inconsistent."""


@dataclass(frozen=True)
class DemoCheckpoint:
    folder: Path  # the serving-format checkpoint (verified)
    provenance: dict[str, Any]

    @property
    def shape(self) -> dict[str, int]:
        return self.provenance["shape"]

    @property
    def number_digits(self) -> int:
        return int(self.provenance["number_digits"])

    @property
    def worker_settings(self) -> dict[str, str]:
        return dict(self.provenance["worker_settings"])

    @property
    def budget(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.provenance["budget"].items()}

    @property
    def version(self) -> str:
        return f"speedrun-w{self.provenance['world_seed']}-t{self.provenance['train_seed']}"

    def describe(self) -> str:
        p = self.provenance
        rows = ", ".join(f"{s['name']} {s['correct']}/{s['total']}" for s in p["stages"])
        return (
            f"the RL model of `{p['command']}` (commit {p['commit'][:7]}, {p['date']}, world seed "
            f"{p['world_seed']}, training seed {p['train_seed']}, {p['rl_updates']} RL updates); on that "
            f"world's {p['split']} split: {rows}"
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DemoCheckpointError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise DemoCheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise DemoCheckpointError(f"{path}: not a JSON object")
    return data


REQUIRED = (
    "results_file", "command", "commit", "date", "machine", "world_seed", "train_seed", "split",
    "rl_updates", "stages", "shape", "number_digits", "worker_settings", "budget",
)  # fmt: skip


def load(root: Path = DEMO_CHECKPOINT) -> DemoCheckpoint:
    """The packaged checkpoint under `root`, its SHA256SUMS and layout verified, its provenance complete."""
    provenance = _read_json(root / PROVENANCE)
    missing = [key for key in REQUIRED if key not in provenance]
    if missing:
        raise DemoCheckpointError(f"{root / PROVENANCE} lacks {', '.join(missing)}")
    folder = root / "checkpoint"
    try:
        verify_checkpoint(folder)
    except VerifyError as e:
        raise DemoCheckpointError(f"{folder} fails verification: {e}") from None
    config = _read_json(folder / "config.json")
    differs = {k: (provenance["shape"].get(k), config.get(k)) for k in SHAPE_FIELDS}
    differs = {k: v for k, v in differs.items() if v[0] != v[1]}
    if differs:
        raise DemoCheckpointError(f"{root / PROVENANCE}'s shape is not the checkpoint's: {differs}")
    return DemoCheckpoint(folder, provenance)


def build_untrained_kit(checkpoint: DemoCheckpoint, out: Path, seed: int = 0) -> Path:
    """A freshly initialised kit of the checkpoint's shape and tokenizer at `out` (built once, reused).

    Raises DemoCheckpointError when its tokenizer files differ from the checkpoint's (a weight
    reload keeps the served tokenizer, so they must be the same).
    """
    from devkit.modelkit.build import build_tiny_kit
    from devkit.modelkit.model import TinyQwen3Shape

    if not (out / "config.json").is_file():
        shape = TinyQwen3Shape(**{k: int(v) for k, v in checkpoint.shape.items()})
        build_tiny_kit(out, seed=seed, shape=shape, number_digits=checkpoint.number_digits, force=True)
    for name in TOKENIZER_FILES:
        if (out / name).read_bytes() != (checkpoint.folder / name).read_bytes():
            raise DemoCheckpointError(
                f"{out / name} differs from the trained checkpoint's {name}: a weight reload keeps the "
                "served tokenizer, so the untrained kit must be built with the checkpoint's (remove "
                f"{out} to rebuild it)"
            )
    return out


def _shown(path: Path) -> str:
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def package(results: Path, state: Path | None, out: Path = DEMO_CHECKPOINT) -> DemoCheckpoint:
    """Copy the RL export a speedrun results file names into `out`, with its provenance; verified."""
    run = _read_json(results)
    for key in ("rl_model", "settings", "stages", "commit", "machine", "date", "command", "world_seed"):
        if key not in run:
            raise DemoCheckpointError(f"{results} is not a bench/speedrun.py results file (no {key!r})")
    if run.get("uncommitted_changes"):
        raise DemoCheckpointError(f"{results} comes from a dirty tree; package a clean run")
    if not run.get("rl_updates"):
        raise DemoCheckpointError(f"{results}: the run made no RL update, so it has no RL model")
    export = Path(run["rl_model"])
    if state is not None:  # the state folder moved since the run: the export's path under it
        parts = export.parts
        if "stack" not in parts:
            raise DemoCheckpointError(f"{results}: rl_model {export} is not under a speedrun state")
        export = state.joinpath(*parts[parts.index("stack") :])
    try:
        verify_checkpoint(export)
    except VerifyError as e:
        raise DemoCheckpointError(f"{export} fails verification: {e}") from None
    config = _read_json(export / "config.json")
    args = run["settings"]["args"]
    provenance = {
        "about": "The trained tiny worker `make demo` hot-reloads (python -m bcstack.demo_checkpoint).",
        "results_file": _shown(results),
        **{k: run[k] for k in ("command", "commit", "date", "machine", "world_seed", "train_seed")},
        "split": run.get("split", "test"),
        "rl_updates": run["rl_updates"],
        "export": export.name,
        "stages": [
            {"name": s["name"], "correct": s["correct"], "total": s["total"], "tiers": s["tiers"]}
            for s in run["stages"]
        ],
        "shape": {k: config[k] for k in SHAPE_FIELDS},
        "number_digits": int(args["number_digits"]),
        "worker_settings": run["settings"]["worker"],
        "budget": run["settings"]["budget"],
    }  # fmt: skip
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shutil.copytree(export, staging / "checkpoint")
    (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return load(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        prog="bcstack.demo_checkpoint",
    )
    parser.add_argument("--results", type=Path, required=True, help="a bench/speedrun.py results JSON")
    parser.add_argument(
        "--state", type=Path, default=None,
        help="the run's state folder, where it moved since (default: the path the results file names)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEMO_CHECKPOINT, help="default demo/trained-tiny")
    args = parser.parse_args(argv)
    try:
        made = package(args.results, args.state, args.out)
    except DemoCheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {made.describe()}")
    print(f"{SUMS_FILE} verified; commit {args.out} to ship it with the demo")
    return 0


if __name__ == "__main__":
    sys.exit(main())
