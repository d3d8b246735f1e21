"""The CPU engine's batched decode cache (services/engine/models.py `_GrowingLayer`): every step writes
its position into buffers with room to spare instead of concatenating the whole cache. Driven
in-process (`TransformersModel.prefill` / `decode`, as the scheduler's step thread calls them) with
the room cut to a few positions, so the buffers grow several times, and with sequences leaving the
batch mid-way, so it is stacked again: greedy tokens and their log-probs equal one forward pass
over each whole sequence, and a view handed out before a write keeps its values."""

from __future__ import annotations

import pytest
import torch

from services.engine import models
from services.engine.protocol import parse_generate_request
from services.engine.sampling import new_generator
from services.engine.sequence import Sequence


@pytest.fixture(scope="module")
def model(tiny_kit, tmp_path_factory) -> models.TransformersModel:
    kit = tiny_kit(tmp_path_factory.mktemp("decode-cache") / "kit")
    return models.TransformersModel.load(kit, tokenizer=None)


def sequence(ids: list[int], new_tokens: int) -> Sequence:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True},
        "return_logprob": True,
    }
    request = parse_generate_request(body)
    return Sequence(request, list(request.input_ids), frozenset(), None, new_generator(0))


def reference_logprobs(model: models.TransformersModel, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= start, from one forward pass without a cache."""
    with torch.no_grad():
        logits = model.model(torch.tensor([ids])).logits[0].float()
    return (
        torch.log_softmax(logits[start - 1 : -1], -1)
        .gather(1, torch.tensor(ids[start:]).view(-1, 1))
        .view(-1)
    )


def test_grown_and_restacked_batches_decode_what_one_forward_pass_scores(model, monkeypatch):
    monkeypatch.setattr(models, "DECODE_ROOM", 2)  # grows after 2 steps, then at 2x, 4x ...
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 4000, (n,), generator=generator).tolist() for n in (5, 40, 17)]
    lengths = [12, 30, 21]  # the first leaves the batch at step 11, the third at 20: stacked again
    seqs = [sequence(ids, n) for ids, n in zip(prompts, lengths, strict=True)]
    logprobs: list[list[float]] = [[] for _ in seqs]
    for i, seq in enumerate(seqs):
        token, logprob = model.prefill(seq)
        seq.output_ids.append(token)
        logprobs[i].append(logprob)
    grown = 0
    while running := [i for i, s in enumerate(seqs) if len(s.output_ids) < lengths[i]]:
        choices = model.decode([seqs[i] for i in running])
        layer = model._batch.cache.layers[0]
        grown = max(grown, layer._keys.shape[2])
        for i, (token, logprob) in zip(running, choices, strict=True):
            seqs[i].output_ids.append(token)
            logprobs[i].append(logprob)
        for i in running:
            if len(seqs[i].output_ids) == lengths[i]:
                model.release(seqs[i])
    assert grown >= 40 + 2 * 2  # the buffers outgrew their first room
    for seq, ids, got in zip(seqs, prompts, logprobs, strict=True):
        whole = ids + seq.output_ids
        expected = reference_logprobs(model, whole, len(ids))
        assert torch.allclose(torch.tensor(got), expected, atol=1e-4)
        # greedy: each token is the reference's most likely one
        with torch.no_grad():
            logits = model.model(torch.tensor([whole])).logits[0]
        assert seq.output_ids == logits[len(ids) - 1 : -1].argmax(-1).tolist()


def test_a_view_handed_out_keeps_its_values_when_the_layer_grows():
    layer_class = models._growing_layer()
    keys = torch.zeros(1, 2, 3 + models.DECODE_ROOM, 4)
    keys[:, :, :3] = 1.0
    layer = layer_class(keys, keys.clone(), 3)
    before, _ = layer.update(torch.full((1, 2, 1, 4), 2.0), torch.full((1, 2, 1, 4), 2.0))
    snapshot = before.clone()
    for step in range(2 * models.DECODE_ROOM):  # past the room: a new, larger buffer
        after, _ = layer.update(torch.full((1, 2, 1, 4), 3.0 + step), torch.full((1, 2, 1, 4), 0.0))
    assert torch.equal(before, snapshot) and before.shape[2] == 4
    assert after.shape[2] == 4 + 2 * models.DECODE_ROOM and torch.equal(after[:, :, :4], snapshot)
    assert float(after[0, 0, -1, 0]) == 3.0 + 2 * models.DECODE_ROOM - 1
