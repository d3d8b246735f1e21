"""Single-turn pass@k evaluation (seed 004): every model on every benchmark, with paired intervals.

Protocol (seed 004): maths and code take `samples` sampled responses per prompt (4, at T 0.7, top-p
0.8, top-k 20) and pass@1 is the mean success over them; instruction following takes one greedy
response per prompt (a benchmark marked `greedy`). Thinking is disabled and responses are capped.

- pass@k for every k up to the sample count, by the unbiased estimator of Chen et al. 2021
  ("Evaluating Large Language Models Trained on Code", eq. 1): per prompt with n samples of which
  c are right, pass@k = 1 − C(n − c, k) / C(n, k), averaged over prompts. pass@1 is then exactly the
  mean success rate.
- Response length: mean response tokens per model and benchmark, and its ratio to the baseline's
  (the seed: "their domain specialists use 2.09x and 3.87x the base model's mean response tokens").
- Paired 95% intervals against the baseline: the per-prompt pass@1 differences (same prompts, both
  models) bootstrapped over prompts (scipy.stats.bootstrap, BCa, 10,000 resamples, fixed seed),
  with the Wilcoxon signed-rank p-value of the same differences. Exploratory, no multiple-testing
  adjustment (as the seed says of its own).

Outputs in OUT: ``responses.jsonl`` (one line per response, appended as each prompt finishes, so a
killed run resumes without redoing finished prompts), ``results.json``, ``table.md`` and ``table.csv``
(the cross-domain table: models x benchmarks, pass@1 %), and ``passk.png`` (grouped bars with the
paired intervals' endpoints drawn as error bars on the non-baseline models).

Models are engines (`NAME=URL`, SGLang or `bcstack serve engine`) or model folders (`NAME=DIR`), for
which a CPU engine is started on a free port for the duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from core.engine_client import EngineClient, EngineError
from core.local_engine import LocalEngine, LocalEngineError
from core.single_turn import PromptRow, SamplingSettings, TextCodec, load_prompts, sample_responses
from core.verifiers import VERIFIERS, Verifier, VerifierError, verifier_for

BOOTSTRAP_RESAMPLES = 10_000
CONFIDENCE = 0.95


class PasskError(ValueError):
    """A bad option or input (one line)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    target: str  # an http(s) URL of an engine, or a model folder

    @property
    def is_engine(self) -> bool:
        return self.target.startswith(("http://", "https://"))


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    path: Path
    verifier: str = "math"
    greedy: bool = False


def parse_model(text: str) -> ModelSpec:
    name, sep, target = text.partition("=")
    if not sep:
        target = text
        name = Path(text.rstrip("/")).name or text
    if not name or not target:
        raise PasskError(f"--model {text!r}: expected NAME=DIR, NAME=URL, DIR or URL")
    spec = ModelSpec(name, target)
    if not spec.is_engine and not (Path(target) / "config.json").is_file():
        raise PasskError(f"--model {text!r}: {target} is neither an http URL nor a model folder")
    return spec


def parse_benchmark(text: str) -> BenchmarkSpec:
    """NAME=FILE[:verifier=math|code|if][:greedy], or FILE (named after its folder and stem)."""
    head, *options = text.split(":")
    name, sep, path = head.partition("=")
    if not sep:
        path, name = head, f"{Path(head).parent.name}-{Path(head).stem}".strip("-")
    verifier, greedy = "math", False
    for option in options:
        key, _, value = option.partition("=")
        if key == "verifier" and value in VERIFIERS:
            verifier = value
        elif key == "greedy" and value in ("", "true"):
            greedy = True
        else:
            raise PasskError(
                f"--prompts {text!r}: unknown option {option!r} (verifier={'|'.join(VERIFIERS)} or greedy)"
            )
    if not Path(path).is_file():
        raise PasskError(f"--prompts {text!r}: no such file {path}")
    return BenchmarkSpec(name, Path(path), verifier, greedy)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021: 1 − C(n − c, k) / C(n, k), the chance that k of the n samples hold a right one."""
    if k > n:
        raise ValueError(f"k={k} > n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def paired_bootstrap(
    diffs: Sequence[float], confidence: float = CONFIDENCE, seed: int = 0
) -> tuple[float, float]:
    """BCa bootstrap interval of the mean per-prompt difference (a constant difference gives a point)."""
    import numpy as np
    from scipy.stats import bootstrap

    data = np.asarray(diffs, dtype=float)
    if len(data) == 0:
        return (math.nan, math.nan)
    if np.all(data == data[0]):
        return (float(data[0]), float(data[0]))
    result = bootstrap(
        (data,),
        np.mean,
        confidence_level=confidence,
        n_resamples=BOOTSTRAP_RESAMPLES,
        method="BCa",
        random_state=np.random.default_rng(seed),
    )
    return (float(result.confidence_interval.low), float(result.confidence_interval.high))


def wilcoxon_p(diffs: Sequence[float]) -> float:
    from scipy.stats import wilcoxon

    nonzero = [d for d in diffs if d != 0]
    if not nonzero:
        return 1.0
    return float(wilcoxon(nonzero).pvalue)


# --- engines ------------------------------------------------------------------------------------------


# --- the run ------------------------------------------------------------------------------------------


def _done_keys(path: Path) -> tuple[dict[tuple[str, str, str], list[dict[str, Any]]], int]:
    """Finished (model, benchmark, prompt) groups in responses.jsonl; a torn last line is dropped."""
    done: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    torn = 0
    if not path.exists():
        return done, torn
    lines = path.read_text(encoding="utf-8").splitlines()
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            torn += 1
            continue
        done.setdefault((row["model"], row["benchmark"], row["prompt_id"]), []).append(row)
    if torn:  # rewrite without the torn line so appends continue a valid file
        path.write_text(
            "".join(json.dumps(r) + "\n" for rows in done.values() for r in rows), encoding="utf-8"
        )
    return done, torn


async def _evaluate_model(
    url: str,
    model: ModelSpec,
    codec: TextCodec,
    benchmarks: Sequence[tuple[BenchmarkSpec, list[PromptRow], Verifier]],
    *,
    samples: int,
    sampling: SamplingSettings,
    seed: int,
    concurrency: int,
    done: dict[tuple[str, str, str], list[dict[str, Any]]],
    out_file: Path,
    progress: Callable[[int], None],
) -> None:
    gate = asyncio.Semaphore(concurrency)
    async with EngineClient(url, timeout_s=3600) as client:
        info = await client.model_info()
        version = info.get("weight_version")

        async def one(bench: BenchmarkSpec, row: PromptRow, verifier: Verifier) -> None:
            key = (model.name, bench.name, row.id)
            if key in done:
                progress(1)
                return
            settings = SamplingSettings(0.0, 1.0, -1, sampling.max_new_tokens) if bench.greedy else sampling
            n = 1 if bench.greedy else samples
            async with gate:
                responses = await sample_responses(client, codec, row, n, settings, seed=seed)
            lines = []
            for i, r in enumerate(responses):
                verdict = verifier.score(r.text, row.label)
                lines.append(
                    {
                        "model": model.name,
                        "benchmark": bench.name,
                        "prompt_id": row.id,
                        "sample": i,
                        "correct": verdict.correct,
                        "extracted": verdict.extracted,
                        "response_tokens": len(r.output_ids),
                        "finish_reason": r.finish_reason,
                        "weight_version": r.weight_version or version,
                        "text": r.text,
                    }
                )
            with out_file.open("a", encoding="utf-8") as f:
                f.write("".join(json.dumps(x) + "\n" for x in lines))
                f.flush()
                os.fsync(f.fileno())
            done[key] = lines
            progress(1)

        await asyncio.gather(*(one(b, r, v) for b, rows, v in benchmarks for r in rows))


def run_passk(
    models: Sequence[ModelSpec],
    benchmarks: Sequence[BenchmarkSpec],
    out: Path,
    *,
    samples: int = 4,
    sampling: SamplingSettings = SamplingSettings(0.7, 0.8, 20, 16_384),
    baseline: str | None = None,
    seed: int = 0,
    concurrency: int = 64,
    limit: int | None = None,
    progress: Callable[[str, int, int], Callable[[int], None]] | None = None,
) -> dict[str, Any]:
    """Evaluate every model on every benchmark; write and return the results (module docstring)."""
    if not models or not benchmarks:
        raise PasskError("give at least one --model and one --prompts")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise PasskError(f"model names repeat: {names}")
    if len({b.name for b in benchmarks}) != len(benchmarks):
        raise PasskError(f"benchmark names repeat: {[b.name for b in benchmarks]}")
    if baseline is not None and baseline not in names:
        raise PasskError(f"--baseline {baseline!r} is not one of the models ({', '.join(names)})")
    if samples < 1:
        raise PasskError("--samples must be at least 1")
    loaded = []
    for bench in benchmarks:
        rows = load_prompts(bench.path, limit=limit)
        verifier = verifier_for(bench.verifier)
        loaded.append((bench, rows, verifier))
    out.mkdir(parents=True, exist_ok=True)
    out_file = out / "responses.jsonl"
    done, _torn = _done_keys(out_file)
    (out / "protocol.json").write_text(
        json.dumps(
            {
                "samples": samples,
                "sampling": sampling.__dict__,
                "greedy_benchmarks": [b.name for b in benchmarks if b.greedy],
                "thinking": "disabled",
                "seed": seed,
                "models": [m.__dict__ for m in models],
                "benchmarks": [{**b.__dict__, "path": str(b.path)} for b in benchmarks],
            },
            indent=2,
        )
        + "\n"
    )
    total = sum(len(rows) for _, rows, _ in loaded)
    for model in models:
        tick = progress(model.name, total, 0) if progress else (lambda _n: None)
        if model.is_engine:
            codec_dir = None
            asyncio.run(_check_engine(model.target))
            engine_cm: Any = contextlib.nullcontext(SimpleNamespace(url=model.target))
        else:
            codec_dir = model.target
            engine_cm = LocalEngine(model.target)
        with contextlib.ExitStack() as stack:
            try:
                engine = stack.enter_context(engine_cm)
            except LocalEngineError as e:
                raise PasskError(str(e)) from None
            codec = TextCodec(codec_dir) if codec_dir else asyncio.run(_codec_from_engine(engine.url))
            try:
                asyncio.run(
                    _evaluate_model(
                        engine.url,
                        model,
                        codec,
                        loaded,
                        samples=samples,
                        sampling=sampling,
                        seed=seed,
                        concurrency=concurrency,
                        done=done,
                        out_file=out_file,
                        progress=tick,
                    )
                )
            except EngineError as e:
                raise PasskError(f"model {model.name}: {e}") from None
    results = summarise(done, models, loaded, samples, baseline)
    write_outputs(out, results)
    return results


async def _check_engine(url: str) -> None:
    async with EngineClient(url, retries=1) as client:
        if not await client.health():
            raise PasskError(f"the engine at {url} does not answer /health")


async def _codec_from_engine(url: str) -> TextCodec:
    async with EngineClient(url, retries=1) as client:
        info = await client.model_info()
    folder = info.get("tokenizer_path") or info.get("model_path")
    if not folder or not (Path(folder) / "tokenizer.json").is_file():
        raise PasskError(
            f"the engine at {url} serves {folder!r}, whose tokenizer.json is not readable here; "
            "give the model as NAME=DIR or run where its folder is mounted"
        )
    return TextCodec(folder)


def summarise(
    done: dict[tuple[str, str, str], list[dict[str, Any]]],
    models: Sequence[ModelSpec],
    loaded: Sequence[tuple[BenchmarkSpec, list[PromptRow], Verifier]],
    samples: int,
    baseline: str | None,
) -> dict[str, Any]:
    cells: dict[str, dict[str, Any]] = {}
    per_prompt: dict[tuple[str, str], dict[str, float]] = {}
    for model in models:
        cells[model.name] = {}
        for bench, rows, _ in loaded:
            n_samples = 1 if bench.greedy else samples
            ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n_samples] + (
                [n_samples] if n_samples not in (1, 2, 4, 8, 16, 32, 64) else []
            )
            pass_k = {k: [] for k in ks}
            lengths, truncated, scores = [], 0, {}
            for row in rows:
                group = done.get((model.name, bench.name, row.id), [])
                if len(group) != n_samples:
                    raise PasskError(
                        f"{model.name} / {bench.name} / {row.id}: {len(group)} of {n_samples} responses"
                    )
                c = sum(bool(g["correct"]) for g in group)
                for k in ks:
                    pass_k[k].append(pass_at_k(n_samples, c, k))
                scores[row.id] = c / n_samples
                lengths += [g["response_tokens"] for g in group]
                truncated += sum(g["finish_reason"] == "length" for g in group)
            per_prompt[(model.name, bench.name)] = scores
            cells[model.name][bench.name] = {
                "prompts": len(rows),
                "samples": n_samples,
                "mode": "greedy" if bench.greedy else f"{n_samples} samples",
                "pass_at_1": 100 * statistics.fmean(pass_k[1]),
                "pass_at_k": {str(k): 100 * statistics.fmean(v) for k, v in pass_k.items()},
                "response_tokens_mean": statistics.fmean(lengths),
                "length_stopped": truncated,
            }
    if baseline is not None:
        for model in models:
            for bench, rows, _ in loaded:
                cell = cells[model.name][bench.name]
                base_cell = cells[baseline][bench.name]
                cell["length_ratio"] = (
                    cell["response_tokens_mean"] / base_cell["response_tokens_mean"]
                    if base_cell["response_tokens_mean"]
                    else math.nan
                )
                if model.name == baseline:
                    continue
                mine, theirs = per_prompt[(model.name, bench.name)], per_prompt[(baseline, bench.name)]
                diffs = [mine[r.id] - theirs[r.id] for r in rows]
                lo, hi = paired_bootstrap(diffs)
                cell["vs_baseline"] = {
                    "delta_pp": 100 * statistics.fmean(diffs),
                    "ci_pp": [100 * lo, 100 * hi],
                    "method": f"paired BCa bootstrap over prompts ({BOOTSTRAP_RESAMPLES:,} resamples), 95%",
                    "wilcoxon_p": wilcoxon_p(diffs),
                    "prompts_better": sum(d > 0 for d in diffs),
                    "prompts_worse": sum(d < 0 for d in diffs),
                }
    return {
        "baseline": baseline,
        "models": [m.name for m in models],
        "benchmarks": [b.name for b, _, _ in loaded],
        "cells": cells,
    }


def render_table(results: dict[str, Any]) -> str:
    benches = results["benchmarks"]
    head = "| Model | " + " | ".join(f"{b} pass@1" for b in benches) + " |"
    lines = [head, "|---|" + "---:|" * len(benches)]
    for model in results["models"]:
        cells = []
        for b in benches:
            cell = results["cells"][model][b]
            text = f"{cell['pass_at_1']:.2f}"
            vs = cell.get("vs_baseline")
            if vs:
                text += f" ({vs['delta_pp']:+.2f}, {vs['ci_pp'][0]:+.2f} to {vs['ci_pp'][1]:+.2f})"
            cells.append(text)
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    notes = []
    if results["baseline"]:
        notes.append(
            f"Percentages. In brackets: the difference from {results['baseline']} in points and its "
            "paired 95% interval (BCa bootstrap over prompts)."
        )
    lengths = "; ".join(
        f"{m}: " + ", ".join(f"{b} {results['cells'][m][b]['response_tokens_mean']:.1f}" for b in benches)
        for m in results["models"]
    )
    notes.append(f"Mean response tokens — {lengths}.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def write_outputs(out: Path, results: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "table.md").write_text(render_table(results))
    with (out / "table.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "model",
                "benchmark",
                "prompts",
                "samples",
                "pass_at_1",
                "delta_pp",
                "ci_low_pp",
                "ci_high_pp",
                "response_tokens_mean",
                "length_ratio",
            ]
        )
        for model in results["models"]:
            for b in results["benchmarks"]:
                c = results["cells"][model][b]
                vs = c.get("vs_baseline") or {}
                ci = vs.get("ci_pp", ["", ""])
                writer.writerow(
                    [
                        model,
                        b,
                        c["prompts"],
                        c["samples"],
                        f"{c['pass_at_1']:.4f}",
                        vs.get("delta_pp", ""),
                        ci[0],
                        ci[1],
                        f"{c['response_tokens_mean']:.2f}",
                        c.get("length_ratio", ""),
                    ]
                )
    _plot(out / "passk.png", results)


def _plot(path: Path, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models, benches = results["models"], results["benchmarks"]
    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(max(5, 1.8 * len(benches) * len(models) ** 0.5), 3.6))
    for i, model in enumerate(models):
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(benches))]
        ys = [results["cells"][model][b]["pass_at_1"] for b in benches]
        errs = None
        if results["baseline"] and model != results["baseline"]:
            base = [results["cells"][results["baseline"]][b]["pass_at_1"] for b in benches]
            lo = [results["cells"][model][b]["vs_baseline"]["ci_pp"][0] for b in benches]
            hi = [results["cells"][model][b]["vs_baseline"]["ci_pp"][1] for b in benches]
            # The interval of the difference, drawn around this model's bar: baseline + [lo, hi].
            errs = [
                [max(0.0, y - (bs + lw)) for y, bs, lw in zip(ys, base, lo, strict=True)],
                [max(0.0, (bs + h) - y) for y, bs, h in zip(ys, base, hi, strict=True)],
            ]
        ax.bar(xs, ys, width, label=model, yerr=errs, capsize=3)
    ax.set_xticks(range(len(benches)), benches)
    ax.set_ylabel("pass@1 (%)")
    ax.set_title(
        "pass@1 by model and benchmark"
        + (f" (bars: paired 95% CI vs {results['baseline']})" if results["baseline"] else ""),
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["BenchmarkSpec", "ModelSpec", "PasskError", "VerifierError", "pass_at_k", "run_passk"]
