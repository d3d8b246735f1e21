"""How long `make test`'s set-up takes on a fresh machine: `scripts/install.sh test` of two commits,
side by side, each into a new virtual environment and an empty `.cache` (SGLang's wheels, checkov).

    python bench/install.py [--baseline REF] [--rounds N] [--purge-debian] [--results FILE] [--dirty-ok]

Each commit is checked out in a throwaway `git worktree` (this checkout is never touched); the runs
alternate (baseline, this commit, baseline, ...) so that a warmer pip cache or a busier mirror
favours neither. `--purge-debian` (root) purges the Debian packages the tests install, and what
only they pulled in, and empties apt's download cache before every run, so that apt downloads and
unpacks them as on a fresh machine; the last run installs them again. Without it they are already
there and the runs time the Python side alone. Writes bench/results/install.md: every run's
seconds, and the median of each commit with their ratio.

The baseline is, by default, the parent of the last commit that changed scripts/install.sh.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Table, print_machine, require_clean_tree, write_results  # noqa: E402

# What scripts/install.sh test adds with apt (openssl aside: every Debian system has it).
DEBIAN = ("prometheus", "chromium", "chromium-driver", "postgresql", "haproxy")


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def default_baseline() -> str:
    last = git("log", "-1", "--format=%H", "--", "scripts/install.sh")
    return git("rev-parse", f"{last}~1")


def purge_debian() -> None:
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    for step in (
        ["apt-get", "purge", "-y", "-qq", *DEBIAN],
        ["apt-get", "autoremove", "--purge", "-y", "-qq"],
        ["apt-get", "clean"],
    ):
        done = subprocess.run(step, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"bench/install.py: {' '.join(step)} failed: {done.stderr.strip()[-500:]}")


def one_run(tree: Path, log: Path) -> tuple[float, int]:
    """Seconds and exit status of `scripts/install.sh test` in `tree`, from nothing installed there."""
    shutil.rmtree(tree / ".venv", ignore_errors=True)
    shutil.rmtree(tree / ".cache", ignore_errors=True)
    start = time.monotonic()
    with log.open("w") as out:
        rc = subprocess.run(
            ["bash", "scripts/install.sh", "test"], cwd=tree, stdout=out, stderr=subprocess.STDOUT
        ).returncode
    return time.monotonic() - start, rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--baseline", help="the commit to compare with (default: before install.sh last changed)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of each commit (default 1)")
    parser.add_argument(
        "--purge-debian", action="store_true", help="purge the tests' Debian packages before every run (root)"
    )
    parser.add_argument("--results", type=Path, help="results file (default bench/results/install.md)")
    parser.add_argument(
        "--dirty-ok",
        action="store_true",
        help="write the results from a checkout with uncommitted changes, stamped DIRTY",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be 1 or more")
    require_clean_tree("install", args.dirty_ok)
    if args.purge_debian and shutil.which("apt-get") is None:
        parser.error("--purge-debian needs apt-get (Debian or Ubuntu)")
    head = git("rev-parse", "HEAD")
    try:
        baseline = git("rev-parse", args.baseline or default_baseline())
    except subprocess.CalledProcessError:
        parser.error(f"--baseline {args.baseline}: not a commit of this checkout")
    print("bench/install.py: scripts/install.sh test, from nothing, two commits side by side")
    print_machine()
    commits = {"baseline": baseline, "this commit": head}
    rows, seconds = [], {name: [] for name in commits}
    with tempfile.TemporaryDirectory(prefix="bench-install-") as tmp:
        trees = {}
        for name, commit in commits.items():
            trees[name] = Path(tmp) / name.replace(" ", "-")
            git("worktree", "add", "--detach", str(trees[name]), commit)
        try:
            for round_ in range(args.rounds):
                for name, commit in commits.items():
                    if args.purge_debian:
                        purge_debian()
                    log = Path(tmp) / f"{name.replace(' ', '-')}-{round_}.log"
                    took, rc = one_run(trees[name], log)
                    if rc != 0:
                        print(log.read_text()[-3000:], file=sys.stderr)
                        raise SystemExit(f"bench/install.py: install at {commit[:7]} exited {rc}")
                    seconds[name].append(took)
                    rows.append(
                        [
                            round_,
                            name,
                            commit[:7],
                            "purged" if args.purge_debian else "installed",
                            round(took, 1),
                        ]
                    )
                    print(f"  round {round_}  {name:12s} {commit[:7]}  {took:7.1f} s", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True
                )
    median = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = median["this commit"] / median["baseline"]
    summary = [[name, commits[name][:7], len(seconds[name]), round(median[name], 1)] for name in commits]
    base, this = median["baseline"], median["this commit"]
    print(f"median: baseline {base:.1f} s, this commit {this:.1f} s, ratio {ratio:.3f}")
    path = write_results(
        "install",
        [
            Table(
                "Every run (seconds from nothing to `install: done`)",
                ["round", "variant", "commit", "Debian packages before", "seconds"],
                rows,
            ),
            Table(
                "Median per commit",
                ["variant", "commit", "runs", "median seconds"],
                summary,
                notes=[f"This commit / baseline: {ratio:.3f}."],
            ),
        ],
        path=args.results,
        dirty_ok=args.dirty_ok,
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
