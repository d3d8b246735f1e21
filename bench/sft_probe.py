"""SFT probe: which tiny-model choices let SFT answer held-out questions, side by side, in minutes.

The speedrun (`make speedrun`) takes ~40 minutes through the live stack; this probe runs the same
learning pipeline in one process so a choice can be compared against another in one run: the same
train episodes, seeds and steps for every variant, only the variant's setting changed.

Per variant: the tiny kit (`build_tiny_kit`, 4 layers x 128, tokenizer on the fixed toy text) ->
the copy stage (`trainer.copy_stage`) -> `bcstack train sft` on expert trajectories (the
`expert-snippets` policy, played offline against the real embedded BM25 backend, observations
rendered by `core.protocol` with the speedrun's worker settings) -> free-running greedy episodes on
held-out easy questions of another world: the first search exactly the question, the episode
finished, the answer correct (exact match), with a Wilson interval. The probe makes choices, so it
reads that world's dev split; the test split only with `--final` (a final report of a choice made).

Variants (`--variants`, comma-separated):
    digits1   Qwen3's pre-tokenizer: every digit its own token (years are four tokens to copy)
    digits4   digit runs of up to four kept together (`--number-digits 4`: a year is one token)

    python bench/sft_probe.py                      # digits1,digits4; ~35 min on 2 cores
    python bench/sft_probe.py --variants digits4 --sft-steps 250

The table, with the command, commit, machine and date, goes to bench/results/sft_probe.md
(--results); refused from a checkout with uncommitted changes unless --dirty-ok (the report then says DIRTY).
Measured on this 2-core box: bench/README.md, "The CPU learning proof".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import Table, print_machine, require_clean_tree, write_results  # noqa: E402

VARIANTS = {"digits1": {"number_digits": 1}, "digits4": {"number_digits": 4}}
# The speedrun's worker observation settings (bcstack/speedrun.py OBSERVATION_SETTINGS).
TOPK, SNIPPET, SEEN_SNIPPET, PAGE_WORDS, MAX_NEW = 3, 24, 12, 48, 192


class Tools:
    """search / open_page over the embedded BM25 backend of the retrieval service, in-process."""

    def __init__(self, corpus: list[dict], folder: Path) -> None:
        from core import protocol as p
        from services.retrieval.backends import Doc
        from services.retrieval.lexical import EmbeddedBM25

        self.p = p
        self.pages = {d["docid"]: p.Page(d["docid"], d["url"], d["text"]) for d in corpus}
        self.by_url = {d["url"]: d["docid"] for d in corpus}
        self.index = EmbeddedBM25(folder)
        self.index.add([Doc(d["docid"], d["text"], d["url"], "") for d in corpus])
        self.index.finalize()

    def observe(self, reply: str, seen: set[str]):
        """(finish action or None, the next user message) for one assistant reply."""
        p = self.p
        calls, parts = p.parse_calls(reply), []
        for call in calls:
            action = p.validate_call(call)
            if isinstance(action, p.FinishAction):
                return action, ""
            if isinstance(action, p.SearchAction):
                hits = [self.pages[d] for d, _ in self.index.search(action.query, 10)]
                parts.append(
                    p.render_search_results(
                        action.query, hits, seen, min(action.topk, TOPK),
                        snippet_words=SNIPPET, seen_snippet_words=SEEN_SNIPPET,
                    )
                )  # fmt: skip
            elif isinstance(action, p.OpenPageAction):
                docid = action.docid or self.by_url.get(action.url or "")
                page = self.pages.get(docid or "")
                parts.append(
                    p.render_open_page([page], page_words=PAGE_WORDS)
                    if page
                    else p.page_not_found_error(action.docid, action.url)
                )
        if not calls:
            parts.append("No function call was detected in the model response.")
        return None, p.finish_observation(parts, reflection_nudge=False)


def episode(question: str, tools: Tools, policy, max_turns: int) -> tuple[list[dict], object]:
    from devkit.toyworld.policies import WORKER_TASK_TEMPLATE
    from services.worker.prompts import WORKER_SYSTEM_PROMPT

    messages = [
        {"role": "system", "content": WORKER_SYSTEM_PROMPT},
        {"role": "user", "content": WORKER_TASK_TEMPLATE.format(question=question)},
    ]
    seen: set[str] = set()
    for _ in range(max_turns):
        reply = policy(messages)
        messages.append({"role": "assistant", "content": reply})
        finish, observation = tools.observe(reply, seen)
        if finish is not None:
            return messages, finish
        messages.append({"role": "user", "content": observation})
    return messages, None


def greedy_policy(model, tokenizer):
    import torch

    from core.chat_template import render_chat

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def policy(messages: list[dict]) -> str:
        prompt = tokenizer(render_chat(messages, add_generation_prompt=True), add_special_tokens=False)
        ids = torch.tensor([prompt["input_ids"]])
        pad = tokenizer.pad_token_id
        out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=end, pad_token_id=pad)
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    return policy


def evaluate(model_dir: Path, test: list[dict], tools: Tools) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bcstack.evaluation.report import wilson_interval

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    policy = greedy_policy(model, AutoTokenizer.from_pretrained(model_dir))
    query_exact = finished = correct = 0
    with torch.no_grad():
        for q in test:
            messages, finish = episode(q["query"], tools, policy, max_turns=6)
            calls = tools.p.parse_calls(messages[2]["content"])
            first = tools.p.validate_call(calls[0]) if calls else None
            query_exact += isinstance(first, tools.p.SearchAction) and first.query.strip() == q["query"]
            if finish is not None:
                finished += 1
                correct += finish.answer.strip().lower() == q["answer"].strip().lower()
    low, high = wilson_interval(correct, len(test))
    return {"query_exact": query_exact, "finished": finished, "correct": correct, "n": len(test),
            "wilson_95": [low, high]}  # fmt: skip


def run_variant(name: str, args, work: Path, rows_path: Path, rows: int, test, tools) -> dict:
    from devkit.modelkit.build import build_tiny_kit
    from devkit.modelkit.corpus import toy_world_corpus
    from devkit.modelkit.model import TinyQwen3Shape
    from trainer.copy_stage import copy_pretrain

    folder = work / name
    h = args.hidden_size
    shape = TinyQwen3Shape(hidden_size=h, num_hidden_layers=args.layers, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=h // 4, intermediate_size=3 * h)  # fmt: skip
    started = time.perf_counter()
    build_tiny_kit(folder / "kit", seed=0, shape=shape, **VARIANTS[name])
    copy = {}
    if args.copy_steps:
        texts = [d["text"] for d in toy_world_corpus().documents]
        copy = copy_pretrain(
            folder / "kit", folder / "base", steps=args.copy_steps, texts=texts, text_fraction=args.copy_text
        )
    start = folder / ("base" if args.copy_steps else "kit")
    epochs = args.sft_steps * args.batch / rows
    command = [
        sys.executable, "-m", "bcstack", "train", "sft", "--model", str(start), "--out", str(folder / "sft"),
        "--source", f"core={rows_path}", "--lr", "2e-3", "--min-lr", "1e-4",
        "--global-batch", str(args.batch),
        "--epochs", f"{epochs:.6f}", "--micro-batch-tokens", str(args.micro_batch_tokens),
        "--checkpoint-every", "100000",
    ]  # fmt: skip
    sft_started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: bcstack train sft failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    sft_seconds = time.perf_counter() - sft_started
    metrics = [json.loads(line) for line in (folder / "sft" / "metrics.jsonl").read_text().splitlines()]
    result = evaluate(folder / "sft" / "serving", test, tools)
    return {
        "variant": name, **VARIANTS[name], **result,
        "copy_accuracy": copy.get("copy_accuracy"), "sft_steps": len(metrics),
        "sft_final_loss": metrics[-1]["loss"] if metrics else None, "sft_seconds": round(sft_seconds),
        "seconds": round(time.perf_counter() - started),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--variants", default="digits1,digits4", help=f"comma-separated, of {', '.join(VARIANTS)}")
    add("--easy", type=int, default=2000, help="easy train questions (expert episodes to learn from)")
    add("--test", type=int, default=50, help="held-out easy questions of another world")
    add("--copy-steps", type=int, default=300)
    add("--copy-text", type=float, default=0.75, help="share of copy rows that are toy text")
    add("--sft-steps", type=int, default=400)
    add("--batch", type=int, default=16)
    add("--micro-batch-tokens", type=int, default=2048)
    add("--hidden-size", type=int, default=128)
    add("--layers", type=int, default=4)
    add("--results", type=Path, default=None, help="results file (default bench/results/sft_probe.md)")
    add("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    add("--final", action="store_true",
        help="evaluate on the held-out world's test split (default: its dev split, for choices)")  # fmt: skip
    args = parser.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")

    require_clean_tree("sft_probe", args.dirty_ok)  # before the run, not after it
    from devkit.toyworld.generator import generate_world
    from devkit.toyworld.policies import expert_worker_policy

    print_machine()
    with tempfile.TemporaryDirectory(prefix="sft-probe-") as tmp:
        work = Path(tmp)
        train_world = generate_world(10_000, 1, questions_per_tier=0, train_easy=args.easy, train_medium=0,
                                     train_hard=0)  # fmt: skip
        test_world = generate_world(3000, 0, dev_per_tier=args.test)
        held = test_world.test if args.final else test_world.dev
        test = [q for q in held if q["data_source"].endswith("easy")][: args.test]
        train_tools = Tools(train_world.corpus, work / "train-index")
        test_tools = Tools(test_world.corpus, work / "test-index")

        def expert(messages: list[dict]) -> str:
            return expert_worker_policy(messages, read_snippets=True)

        rows_path = work / "expert.jsonl"
        with rows_path.open("w") as out:
            for q in train_world.train:
                messages, _ = episode(q["query"], train_tools, expert, max_turns=8)
                out.write(json.dumps({"messages": messages, "supervise": "assistant"}) + "\n")
        split = "test" if args.final else "dev"
        print(
            f"{len(train_world.train)} expert episodes, {len(test)} held-out easy {split} questions",
            flush=True,
        )
        results = []
        for name in names:
            print(f"== {name}", flush=True)
            results.append(run_variant(name, args, work, rows_path, len(train_world.train), test, test_tools))
            print(json.dumps(results[-1]), flush=True)

    setting = (
        f"{args.easy} easy train episodes; copy {args.copy_steps} steps ({args.copy_text:.0%} text); "
        f"SFT {args.sft_steps} steps x {args.batch} rows, LR 2e-3 cosine to 1e-4; greedy, 6 turns"
    )
    columns = ["variant", "number_digits", "first search exact", "finished", "correct", "n", "Wilson 95% low",
               "Wilson 95% high", "copy accuracy", "SFT steps", "SFT final loss", "SFT seconds",
               "seconds"]  # fmt: skip
    rows = [
        [r["variant"], r["number_digits"], r["query_exact"], r["finished"], r["correct"], r["n"],
         r["wilson_95"][0], r["wilson_95"][1], r["copy_accuracy"], r["sft_steps"], r["sft_final_loss"],
         r["sft_seconds"], r["seconds"]]
        for r in results
    ]  # fmt: skip
    notes = []
    if len(results) == 2 and results[0]["correct"]:
        ratio = results[1]["correct"] / results[0]["correct"]
        notes.append(f"correct, {results[1]['variant']} / {results[0]['variant']}: {ratio:.2f}x")
    table = Table(
        f"Held-out easy {'test' if args.final else 'dev'} questions, free-running greedy episodes",
        columns,
        rows,
        notes,
    )
    path = write_results(
        "sft_probe", [table], {"setting": setting}, path=args.results, dirty_ok=args.dirty_ok
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
