"""Packed dynamic batches: first-fit bins, the packed row's layout, sample isolation inside a packed row
on the tiny Qwen3, and the key invariant: packed micro-batches with gradient accumulation give the
gradient of the whole batch at once, for the varlen attention (no mask tensor) and the dense-mask
implementations alike; the chunked output head gives the unchunked log-probs and gradients."""

from __future__ import annotations

import dataclasses
import math
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from trainer.attention import VARLEN, varlen_kwargs
from trainer.data import Sample
from trainer.packing import (
    first_fit_pack,
    pack,
    pack_micro_batches,
    per_token_logprobs,
    sample_token_means,
    token_logprobs,
)

# --- first fit ----------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(data=st.data(), budget=st.integers(min_value=1, max_value=200))
def test_first_fit_places_every_index_once_within_budget(data: st.DataObject, budget: int) -> None:
    lengths = data.draw(st.lists(st.integers(min_value=0, max_value=budget), max_size=60))
    bins = first_fit_pack(lengths, budget)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert all(load <= budget for load in loads)
    assert all(b for b in bins) and all(b == sorted(b) for b in bins)
    # First fit never leaves two bins both at most half full (the later one's items would have fit).
    assert sum(1 for load in loads if 2 * load <= budget) <= 1
    assert first_fit_pack(lengths, budget) == bins


def test_first_fit_decreasing_example() -> None:
    # Longest first: 5->A, 4->B, 3->A (full), 3->B, 2->C, 1->B (full).
    assert first_fit_pack([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    assert first_fit_pack([], 8) == []


def test_first_fit_rejects_a_sample_over_the_budget() -> None:
    with pytest.raises(
        ValueError, match="sample 2 has 9 tokens, more than the micro-batch token budget of 8"
    ):
        first_fit_pack([3, 8, 9, 1], 8)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        first_fit_pack([1], 0)
    with pytest.raises(ValueError, match="sample 0 has a negative length"):
        first_fit_pack([-1], 4)


# --- the packed row -------------------------------------------------------------------------------------


def _sample(token_ids: list[int], loss_mask: list[int], logprobs: list[float], name: str = "w") -> Sample:
    return Sample(
        token_ids=token_ids,
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        group_id="g",
        episode_id="e",
        worker_episode_id=name,
        question_id="q",
        episode_reward=None,
        contribution=None,
        weight_versions=("v1",),
    )


def test_pack_layout_restarts_positions_and_blocks_attention_across_samples() -> None:
    samples = [
        _sample([5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.25], "a"),
        [8, 9],  # a bare token sequence: trained on every token but the first
        _sample([1, 2, 3, 4], [0, 0, 1, 0], [0.0, 0.0, -1.0, 0.0], "c"),
    ]
    batch = pack(samples, [2, 0, 1])
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]
    assert batch.sample_index.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2, 2]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0, 0, 1, 1, 0, 1]]
    assert batch.rollout_logprobs.tolist() == [[0, 0, -1.0, 0, 0, -0.5, -0.25, 0, 0]]
    assert batch.indices == (2, 0, 1)
    assert batch.slices == (slice(0, 4), slice(4, 7), slice(7, 9))
    assert (batch.num_tokens, batch.num_samples) == (9, 3)

    expected = torch.zeros(9, 9, dtype=torch.bool)
    for s in batch.slices:
        n = s.stop - s.start
        expected[s, s] = torch.ones(n, n, dtype=torch.bool).tril()
    dense = batch.dense_attention_mask()
    assert dense.shape == (1, 1, 9, 9) and dense.dtype == torch.bool
    assert torch.equal(dense[0, 0], expected)
    additive = batch.additive_mask(torch.float32)
    assert torch.equal(additive == 0, dense)
    assert additive.min().item() == torch.finfo(torch.float32).min
    # The varlen route's whole description of the layout: O(samples), no T x T tensor.
    lengths = varlen_kwargs(batch.position_ids)
    assert lengths["cu_seq_lens_q"].tolist() == [0, 4, 7, 9] and lengths["max_length_q"] == 4
    assert not any(f.name == "attention_mask" for f in dataclasses.fields(batch))


def test_varlen_kwargs_refuse_a_row_that_does_not_start_a_sample() -> None:
    with pytest.raises(ValueError, match="start at 0"):
        varlen_kwargs(torch.tensor([[3, 4, 0, 1]]))
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        varlen_kwargs(torch.tensor([0, 1]))


def test_pack_refuses_empty_and_misaligned_input() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        pack([[1, 2]], [])
    with pytest.raises(ValueError, match="sample 0: 3 token ids, 2 loss-mask values"):
        pack([_sample([1, 2, 3], [0, 1], [0.0, 0.0])], [0])
    with pytest.raises(ValueError, match="repeat"):
        pack([[1, 2]], [0, 0])


def test_micro_batches_cover_every_sample_once_with_no_padding() -> None:
    sequences = [list(range(n)) for n in (30, 5, 17, 24, 9, 12, 3, 40)]
    batches = pack_micro_batches(sequences, budget=40)
    assert sorted(i for b in batches for i in b.indices) == list(range(len(sequences)))
    assert all(b.num_tokens <= 40 for b in batches)
    assert sum(b.num_tokens for b in batches) == sum(len(s) for s in sequences)
    for b in batches:
        assert b.input_ids.tolist()[0] == [t for i in b.indices for t in sequences[i]]


def test_sample_token_means_average_each_samples_trained_tokens() -> None:
    batch = pack([[1, 2, 3], _sample([4, 5], [0, 0], [0.0, 0.0]), [6, 7]], [0, 1, 2])
    values = torch.tensor([[9.0, 1.0, 3.0, 9.0, 9.0, 9.0, 5.0]])
    assert sample_token_means(values, batch).tolist() == [2.0, 0.0, 5.0]


# --- on the tiny Qwen3 ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kit_dir(tmp_path_factory: pytest.TempPathFactory, tiny_kit) -> Path:
    return tiny_kit(tmp_path_factory.mktemp("trainer-packing") / "tiny")


def _load(kit_dir: Path, attn_implementation: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        kit_dir, dtype=torch.float32, attn_implementation=attn_implementation
    )


def _random_samples(model: torch.nn.Module, lengths: list[int], seed: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    samples = []
    for k, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        mask = [0] + (torch.rand(n - 1, generator=gen) < 0.6).long().tolist()
        mask[-1] = 1  # every sample has at least one trained token
        samples.append(_sample(ids, mask, [-0.5 if m else 0.0 for m in mask], f"w{k}"))
    return samples


def _logprobs_alone(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Reference without any packing code: a plain forward of one sequence, default mask and positions."""
    ids = torch.tensor([token_ids])
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    return torch.cat([torch.zeros(1), logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)])


@pytest.mark.parametrize("attn_implementation", [VARLEN, "eager", "sdpa"])
def test_a_sample_packed_with_others_has_its_log_probs_computed_alone(
    kit_dir: Path, attn_implementation: str
) -> None:
    model = _load(kit_dir, attn_implementation)
    plain = _load(kit_dir, "eager")  # the same weights, run the plain way
    samples = _random_samples(model, [11, 23, 6, 17], seed=1)
    batch = pack(samples, [1, 3, 0, 2])
    with torch.no_grad():
        packed = per_token_logprobs(model, batch)[0]
        for k, index in enumerate(batch.indices):
            alone = _logprobs_alone(plain, samples[index].token_ids)
            torch.testing.assert_close(packed[batch.slices[k]], alone, atol=1e-5, rtol=0)
        # The check has teeth: seen as one sample (attention crossing samples) they differ.
        leaky = dataclasses.replace(
            batch,
            sample_index=torch.zeros_like(batch.sample_index),
            position_ids=torch.arange(batch.num_tokens)[None],
        )
        crossed = per_token_logprobs(model, leaky)[0]
    later = batch.slices[1]
    assert (crossed[later] - packed[later]).abs().max() > 1e-3


def test_per_token_logprobs_refuses_attention_that_ignores_a_4d_mask() -> None:
    fake = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.raises(ValueError, match="bcstack_varlen, eager, sdpa.*flash_attention_2"):
        per_token_logprobs(fake, pack([[1, 2]], [0]))


@pytest.mark.parametrize("attn_implementation", [VARLEN, "eager"])
def test_packed_micro_batches_with_accumulation_give_the_full_batch_gradient(
    kit_dir: Path, attn_implementation: str
) -> None:
    model = _load(kit_dir, "eager")  # the reference: a padded batch with transformers' own masks
    samples = _random_samples(model, [19, 7, 31, 12, 25, 9, 16, 4], seed=2)
    n = len(samples)

    # (a) One forward over all samples, right-padded to the longest, with a 2D padding mask.
    width = max(len(s) for s in samples)
    ids = torch.zeros(n, width, dtype=torch.int64)
    attention = torch.zeros(n, width, dtype=torch.int64)
    trained = torch.zeros(n, width)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = torch.tensor(s.token_ids)
        attention[i, : len(s)] = 1
        trained[i, : len(s)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = trained[:, 1:]
    full_loss = -((logp * mask).sum(1) / mask.sum(1)).mean()
    full_loss.backward()
    full_grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    # (b) Packed micro-batches under a small token budget; each micro-batch's loss is the sum of its
    # samples' token means over the step's sample count, so the accumulated grads sum to (a)'s.
    model.zero_grad()
    model.set_attn_implementation(attn_implementation)
    batches = pack_micro_batches(samples, budget=40)
    assert len(batches) >= 3 and any(b.num_samples > 1 for b in batches)
    packed_loss = 0.0
    for batch in batches:
        loss = -sample_token_means(per_token_logprobs(model, batch), batch).sum() / n
        loss.backward()
        packed_loss += loss.item()

    assert packed_loss == pytest.approx(full_loss.item(), abs=1e-5)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(
            p.grad, full_grads[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert any(g.abs().max() > 1e-3 for g in full_grads.values())  # a gradient worth comparing


def test_chunked_output_head_gives_the_unchunked_log_probs_and_gradients(kit_dir: Path) -> None:
    model = _load(kit_dir, VARLEN)
    hidden = torch.randn(37, model.config.hidden_size, requires_grad=True)
    targets = torch.randint(0, model.config.vocab_size, (37,))
    grads = []
    for chunk in (1000, 5):  # one chunk; eight chunks, each checkpointed
        model.zero_grad()
        hidden.grad = None
        logprobs = token_logprobs(model.lm_head, hidden, targets, chunk_tokens=chunk)
        (logprobs * torch.linspace(0.5, 1.5, 37)).sum().backward()
        grads.append((logprobs.detach(), hidden.grad.clone(), model.lm_head.weight.grad.clone()))
    for whole, chunked in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-5)
    reference = model.lm_head(hidden).float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(grads[0][0], reference.detach(), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs(model.lm_head, hidden, targets, chunk_tokens=0)


def test_an_episode_budget_micro_batch_trains_in_less_memory_than_its_dense_mask(kit_dir: Path) -> None:
    """24,576 packed tokens (four samples up to 12,000 long), forward and backward through the trainer's
    varlen attention and chunked head: the step's peak RSS growth stays below what a T x T float32
    mask alone would take (2.4 GB). Measured here: 0.84 GB; the dense-mask "sdpa" route peaked at
    3.2 GB on the same batch (tests/packed_memory_probe.py runs either)."""
    import json
    import subprocess
    import sys

    probe = Path(__file__).with_name("packed_memory_probe.py")
    done = subprocess.run(
        [sys.executable, str(probe), str(kit_dir), VARLEN], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    tokens = result["tokens"]
    assert tokens == 24_576 and math.isfinite(result["loss"])
    dense_mask_bytes = tokens * tokens * 4
    grown = result["peak"] - result["rss_before"]
    assert grown < dense_mask_bytes, f"the step grew the process by {grown / 2**30:.2f} GiB"
