"""Benchmark: toy-world generation time and memory by corpus size.

    python bench/toyworld.py [--sizes 2000,20000,100000] [--seed 0]

Each size runs `bcstack toyworld generate` in a fresh process (so peak memory is that size's
own), writing to a temporary directory. The report gives wall time, documents per second, peak
RSS, the corpus file size, and each size's time per document relative to the smallest size
(a ratio near 1 means generation scales linearly).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_machine  # noqa: E402


def run(size: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "world"
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        start = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bcstack",
                "toyworld",
                "generate",
                "--out",
                str(out),
                "--docs",
                str(size),
                "--seed",
                str(seed),
            ],
            check=True,
            capture_output=True,
        )
        wall = time.perf_counter() - start
        peak_kib = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
        corpus_bytes = (out / "corpus.jsonl").stat().st_size
        manifest = json.loads((out / "world.json").read_text())
    return {
        "docs": size,
        "wall_s": wall,
        "peak_rss_mib": peak_kib / 1024,
        "corpus_mib": corpus_bytes / 2**20,
        "questions": manifest["test_questions"] + manifest["train_questions"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="2000,20000,100000")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print("toy-world generation benchmark")
    print_machine()
    rows = [run(n, args.seed) for n in sizes]
    base = rows[0]["wall_s"] / rows[0]["docs"]
    header = (
        ("docs", 8),
        ("wall s", 8),
        ("docs/s", 10),
        ("peak RSS MiB", 13),
        ("corpus MiB", 11),
        ("s/doc vs first", 15),
    )
    print("\n" + " ".join(f"{name:>{width}}" for name, width in header))
    for r in rows:
        ratio = (r["wall_s"] / r["docs"]) / base
        print(
            f"{r['docs']:>8,} {r['wall_s']:>8.2f} {r['docs'] / r['wall_s']:>10,.0f} "
            f"{r['peak_rss_mib']:>13.0f} {r['corpus_mib']:>11.1f} {ratio:>15.2f}"
        )
    print("\n(wall time includes the process start-up, which dominates the smallest size)")


if __name__ == "__main__":
    main()
