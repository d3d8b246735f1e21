"""The copy-inducing stage (trainer/copy_stage.py): its batches, its text rows, its refusals, and a
short run on the tiny model that lowers the copy loss and saves a model that loads."""

from __future__ import annotations

import pytest
import torch

from trainer.copy_stage import copy_batch, copy_pretrain


def test_a_batch_is_a_span_followed_by_itself_and_text_rows_are_windows_of_the_text():
    text = torch.arange(1000, 1300)  # ids no random row below vocab=100 can hold
    ids = copy_batch(torch.Generator().manual_seed(0), 100, batch=8, span=16, text=text, text_rows=3)
    assert ids.shape == (8, 32)
    assert torch.equal(ids[:, :16], ids[:, 16:])
    for row in ids[:3, :16]:
        start = int(row[0]) - 1000
        assert torch.equal(row, text[start : start + 16])  # a contiguous window
    assert int(ids[3:].max()) < 100 and int(ids[3:].min()) >= 0
    # The same generator seed gives the same batch.
    again = copy_batch(torch.Generator().manual_seed(0), 100, batch=8, span=16, text=text, text_rows=3)
    assert torch.equal(ids, again)


def test_bad_text_settings_are_refused_before_any_training(tmp_path):
    with pytest.raises(ValueError, match="text_fraction must be in"):
        copy_pretrain(tmp_path, tmp_path / "out", steps=1, text_fraction=1.5)
    with pytest.raises(ValueError, match="needs texts"):
        copy_pretrain(tmp_path, tmp_path / "out", steps=1, text_fraction=0.5)


def test_a_short_run_lowers_the_copy_loss_and_saves_a_loadable_model(toy_kit, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = [d["text"] for d in toy_kit["world"].corpus[:50]]
    losses: list[float] = []
    stats = copy_pretrain(
        toy_kit["dir"] / "tiny", tmp_path / "base", steps=40, batch=8, span=32, warmup=5,
        texts=texts, text_fraction=0.5, on_step=lambda _s, m: losses.append(m["loss"]),
    )  # fmt: skip
    assert len(losses) == 40 and stats["step"] == 40 and stats["tokens"] == 40 * 8 * 64
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # the loss falls
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "base")
    assert model.config.vocab_size >= len(tokenizer)

    with pytest.raises(ValueError, match="copying needs more than the span"):
        copy_pretrain(toy_kit["dir"] / "tiny", tmp_path / "x", steps=1, texts=["a b"], text_fraction=1.0)
