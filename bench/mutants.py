"""Do the learning tests fail when learning breaks? Each mutant breaks one piece of a trainer (the
advantage's sign, the optimizer step, the LoRA scaling, the loss mask), and the tests that guard
it must then fail; unmutated, the same tests must pass.

    python bench/mutants.py [--only NAME[,NAME]] [--results FILE] [--dirty-ok]

Every mutant runs in a throwaway `git worktree` of HEAD (this checkout is never touched): the
one-line source change is applied there (the text it replaces must occur exactly once, or the
mutant is refused as stale) and its tests run there with `python -m pytest` (the worktree first on
sys.path, so the mutated modules are the ones imported, and the subprocesses the live tests start
run from there too). A mutant is *killed* when at least one of its tests fails. Writes
bench/results/mutants.md: the mutants, their tests, killed or not, the seconds; exits 1 if any
mutant survives or the unmutated baseline fails. Hand-written because mutation tools (mutmut,
cosmic-ray) mutate every operator in a module and would take hours on these tests; these five
mutants are the ones issue 31 names, each aimed at the behaviour its tests claim to guard.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Table, print_machine, require_clean_tree, write_results  # noqa: E402

STEPS = "tests/test_learning_steps.py"
GRPO_STEP = (
    f"{STEPS}::test_one_grpo_update_raises_the_rewarded_turns_lowers_the_punished_and_ignores_observations"
)
LORA_STEP = (
    f"{STEPS}::test_one_lora_grpo_update_raises_the_positive_advantage_responses_and_lowers_the_negative"
)
DISTILL_STEP = f"{STEPS}::test_one_distillation_update_moves_the_student_toward_the_teacher"
SFT_STEP = f"{STEPS}::test_a_few_sft_steps_lower_the_loss_on_a_fixed_batch"
RL_LIVE = (
    "tests/test_rl_loop.py::"
    "test_one_update_on_the_judges_grades_of_the_workers_answers_raises_a_correct_trajectory"
)
GRPO_STACK = "tests/test_trainer_grpo.py::test_the_update_raises_the_rewarded_answer_and_lowers_the_other"
MERGE = "tests/test_lora.py::test_merged_state_dict_is_base_plus_delta_and_leaves_the_adapter_unmerged"


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant(
        "grpo-advantage-sign",
        "full-model GRPO trains on −A",
        "trainer/grpo.py",
        "advantages = torch.tensor([c.advantage for c in credit], dtype=torch.float32)",
        "advantages = -torch.tensor([c.advantage for c in credit], dtype=torch.float32)",
        (GRPO_STEP, GRPO_STACK, RL_LIVE),
    ),
    Mutant(
        "grpo-no-optimizer-step",
        "full-model GRPO computes gradients and never steps",
        "trainer/grpo.py",
        "            optimizer.step()\n            optimizer.zero_grad(set_to_none=True)\n            norms",
        "            optimizer.zero_grad(set_to_none=True)\n            norms",
        (GRPO_STEP, GRPO_STACK, RL_LIVE),
    ),
    Mutant(
        "grpo-observations-in-loss",
        "full-model GRPO trains on every token, tool observations included",
        "trainer/grpo.py",
        "mask = _rows(batch.loss_mask, batch).to(device)",
        "mask = torch.ones_like(_rows(batch.loss_mask, batch)).to(device)",
        (GRPO_STEP,),
    ),
    Mutant(
        "lora-grpo-advantage-sign",
        "LoRA GRPO (specialists) trains on −A",
        "trainer/specialist.py",
        "advantages[0, batch.slices[k]] = examples[i][1]",
        "advantages[0, batch.slices[k]] = -examples[i][1]",
        (LORA_STEP,),
    ),
    Mutant(
        "lora-grpo-no-optimizer-step",
        "LoRA GRPO computes gradients and never steps",
        "trainer/specialist.py",
        "        optimizer.step()\n        for key in stats:",
        "        for key in stats:",
        (LORA_STEP,),
    ),
    Mutant(
        "lora-merge-no-scaling",
        "the FP32 merge adds B·A without peft's alpha / rank scaling",
        "trainer/lora.py",
        "delta = layer.get_delta_weight(adapter).to(torch.float32)",
        "delta = (layer.lora_B[adapter].weight @ layer.lora_A[adapter].weight).to(torch.float32)",
        (MERGE,),
    ),
    Mutant(
        "distill-advantage-sign",
        "distillation pushes the student away from the teacher",
        "trainer/distill.py",
        "        -kl_weight * (s - (t if t is not None else s))",
        "        kl_weight * (s - (t if t is not None else s))",
        (DISTILL_STEP,),
    ),
    Mutant(
        "sft-no-optimizer-step",
        "SFT computes gradients and never steps",
        "trainer/sft.py",
        "    grad_norm = grad_norm_clip(model.parameters(), grad_clip)\n    optimizer.step()\n",
        "    grad_norm = grad_norm_clip(model.parameters(), grad_clip)\n",
        (SFT_STEP,),
    ),
)


def run_tests(worktree: Path, tests: tuple[str, ...], log: Path) -> tuple[list[str], float]:
    """Run `tests` in `worktree`; (the tests that did not pass, seconds). Output goes to `log`.

    PYTHONPATH names the worktree, so the processes the live tests start import it too (the
    editable install points at the main checkout)."""
    started = time.perf_counter()
    junit = log.with_suffix(".xml")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(worktree), os.environ.get("PYTHONPATH")])),
    }
    with log.open("w") as out:
        subprocess.run(
            [*cmd, f"--junitxml={junit}", *tests], cwd=worktree, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    passed = set()
    if junit.exists():
        for case in ElementTree.parse(junit).iter("testcase"):
            if not any(child.tag in ("failure", "error", "skipped") for child in case):
                path = case.get("classname", "").replace(".", "/") + ".py"
                passed.add(f"{path}::{case.get('name')}")
    return [t for t in tests if t not in passed], time.perf_counter() - started


def in_worktree(mutant: Mutant | None, logs: Path) -> tuple[list[str], float]:
    """Apply `mutant` (None: the baseline) in a fresh worktree of HEAD and run its tests there."""
    tests = tuple(dict.fromkeys(t for m in MUTANTS for t in m.tests)) if mutant is None else mutant.tests
    name = "baseline" if mutant is None else mutant.name
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        worktree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(worktree), "HEAD"], check=True
        )
        try:
            if mutant is not None:
                source = worktree / mutant.path
                text = source.read_text()
                if text.count(mutant.old) != 1:
                    raise SystemExit(
                        f"bench/mutants.py: mutant {mutant.name}: its text occurs {text.count(mutant.old)} "
                        f"times in {mutant.path} (once expected); the code moved, update the mutant"
                    )
                source.write_text(text.replace(mutant.old, mutant.new))
            return run_tests(worktree, tests, logs / f"{name}.log")
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False
            )


def _short(test: str) -> str:
    return test.removeprefix("tests/").replace("::", " :: ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    parser.add_argument("--results", type=Path, default=None, help="report file (default bench/results/)")
    parser.add_argument("--logs", type=Path, default=None, help="pytest logs (default: a temporary folder)")
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    args = parser.parse_args(argv)
    names = {m.name for m in MUTANTS}
    only = {n for n in args.only.split(",") if n}
    if only - names:
        parser.error(
            f"unknown mutant(s) {', '.join(sorted(only - names))}; known: {', '.join(sorted(names))}"
        )
    require_clean_tree("mutants", args.dirty_ok)  # the mutants are applied to HEAD, not to the tree
    print_machine()
    chosen = [m for m in MUTANTS if not only or m.name in only]
    logs = args.logs or Path(tempfile.mkdtemp(prefix="mutants-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    failed, seconds = in_worktree(None, logs)
    print(
        f"baseline: {'passed' if not failed else 'FAILED: ' + ', '.join(failed)} in {seconds:.0f} s",
        flush=True,
    )
    rows.append(
        ["(none: HEAD)", "the tests below, unmutated", "—", "passed" if not failed else "FAILED", seconds]
    )
    survivors = []
    for mutant in chosen:
        failed, seconds = in_worktree(mutant, logs)
        verdict = f"killed ({len(failed)} of {len(mutant.tests)} tests failed)" if failed else "survived"
        print(f"{mutant.name}: {verdict} in {seconds:.0f} s", flush=True)
        if not failed:
            survivors.append(mutant.name)
        cells = [("FAILED " if t in failed else "passed ") + _short(t) for t in mutant.tests]
        rows.append([mutant.name, mutant.what, "<br>".join(cells), verdict, seconds])
    path = write_results(
        "mutants",
        [
            Table(
                "Mutants and the tests that must catch them",
                ["mutant", "what it breaks", "its tests", "result", "seconds"],
                rows,
                notes=[
                    "killed = at least one of the mutant's tests failed (each test's outcome is "
                    "listed); every mutant is one source change in a fresh worktree of the commit "
                    "above (the change itself: `MUTANTS` in bench/mutants.py)."
                ],
            )
        ],
        {"logs": str(logs)},
        args.results,
        dirty_ok=args.dirty_ok,
    )
    print(f"wrote {path}")
    return 0 if rows[0][3] != "FAILED" and not survivors else 1


if __name__ == "__main__":
    raise SystemExit(main())
