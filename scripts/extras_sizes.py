"""Install every per-service extra of browsecomp-stack into its own fresh virtual environment and
report what each carries: distributions, installed size, and the largest few.

    python scripts/extras_sizes.py [--extras coordinator,judge,...] [--keep DIR]

Prints a Markdown table (the docs/operating.md's "Lean images" table) with the machine and commit. Every
install uses constraints.txt, so torch is the pinned CPU build; sizes include bytecode, as an
image build would have it. tests/test_extras.py checks the light extras on every `make test`; this
script covers the heavy ones too (minutes: three of them install torch).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXTRAS = ("coordinator", "judge", "worker", "retrieval", "engine", "loadtest", "eval", "trainer")
WATCH = ("torch", "transformers", "locust", "matplotlib", "scipy", "sentence-transformers")
# What each extra must be able to import (its services' modules and commands).
IMPORTS = {
    "coordinator": ["services.coordinator.service", "services.coordinator_llm.service"],
    "judge": ["services.judge.service"],
    "worker": ["services.worker.service"],
    "retrieval": [
        "services.retrieval.service",
        "services.retrieval.index",
        "services.retrieval.onnx_embedder",
    ],
    "engine": ["services.engine.service"],
    "loadtest": ["services.retrieval.loadtest_locust"],
    "eval": ["bcstack.evaluation.runner", "bcstack.evaluation.report"],
    "trainer": [
        "trainer.cli",
        "trainer.sft_cli",
        "bcstack.rl.loop",
        "bcstack.rl.report",
        "services.worker.rolling",
    ],
}


def tree_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 1e6


def build_wheel(root: Path) -> Path:
    """The package as a wheel, built from a copy of the sources (so no build/ is left in the checkout)."""
    src = root / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("core", "devkit", "bcstack", "services", "trainer"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(root), str(src)], check=True
    )
    return next(root.glob("browsecomp_stack-*.whl"))


def measure(extra: str, root: Path, wheel: Path) -> dict:
    venv = root / extra
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    started = time.monotonic()
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "-c", str(REPO / "constraints.txt"), f"{wheel}[{extra}]"],
        check=True,
    )  # fmt: skip
    seconds = time.monotonic() - started
    for module in IMPORTS.get(extra, []):
        subprocess.run([str(venv / "bin" / "python"), "-c", f"import {module}"], check=True, cwd=venv)
    site = next((venv / "lib").glob("python3*/site-packages"))
    sizes: dict[str, float] = {}
    for info in site.glob("*.dist-info"):
        name = info.name.split("-")[0].lower().replace("_", "-")
        files = [line.split(",")[0] for line in (info / "RECORD").read_text().splitlines() if line]
        sizes[name] = sum((site / f).stat().st_size for f in files if (site / f).is_file()) / 1e6
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:4]
    return {
        "extra": extra,
        "dists": len(sizes),
        "mb": tree_mb(venv),
        "seconds": seconds,
        "largest": ", ".join(f"{n} {mb:.0f}" for n, mb in largest),
        "heavy": ", ".join(w for w in WATCH if w in sizes) or "none",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", default=",".join(EXTRAS), help="comma-separated extras to measure")
    parser.add_argument("--keep", type=Path, help="keep the venvs under this folder")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bcstack-extras-"))
    rows = []
    try:
        wheel = build_wheel(root / "wheel")
        for extra in args.extras.split(","):
            print(f"installing [{extra}] ...", file=sys.stderr, flush=True)
            rows.append(measure(extra.strip(), root, wheel))
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"Machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"commit {commit.stdout.strip()}\n")  # fmt: skip
    print("| extra | distributions | installed MB | of which heavy | largest (MB) | install s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"`[{r['extra']}]`", r["dists"], f"{r['mb']:.0f}", r["heavy"], r["largest"]]
        cells.append(f"{r['seconds']:.0f}")
        print("| " + " | ".join(str(c) for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
