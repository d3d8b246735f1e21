"""RRF pinned by hand-computed cases."""

from __future__ import annotations

import pytest

from services.retrieval.fusion import RetrieverRank, rrf_fuse, single_ranking


def test_hand_computed_two_retrievers():
    lexical = [("a", 12.0), ("b", 9.0), ("c", 3.0)]
    dense = [("c", 0.9), ("a", 0.8), ("d", 0.1)]
    hits = rrf_fuse({"lexical": lexical, "dense": dense}, k=60)
    # a: 1/61 + 1/62; c: 1/63 + 1/61; b: 1/62; d: 1/63
    expected = {"a": 1 / 61 + 1 / 62, "c": 1 / 63 + 1 / 61, "b": 1 / 62, "d": 1 / 63}
    assert [h.docid for h in hits] == ["a", "c", "b", "d"]
    for h in hits:
        assert h.score == pytest.approx(expected[h.docid], abs=1e-15)
    a = hits[0]
    assert a.ranks == {"lexical": RetrieverRank(1, 12.0), "dense": RetrieverRank(2, 0.8)}
    assert hits[2].ranks == {"lexical": RetrieverRank(2, 9.0)}


def test_k_changes_the_order():
    # x is first in one list only; y is second in both. Small k favours x, large k favours y.
    lists = {"l": [("x", 1.0), ("y", 0.5)], "d": [("z", 1.0), ("y", 0.5), ("x", 0.1)]}
    small = rrf_fuse(lists, k=0)  # x: 1 + 1/3 = 1.333; y: 1/2 + 1/2 = 1.0; z: 1
    assert [h.docid for h in small] == ["x", "y", "z"]
    big = rrf_fuse(lists, k=60)  # y: 2/62 = .03226; x: 1/61 + 1/63 = .03227 -> x still ahead
    assert big[0].docid == "x" and big[1].docid == "y"
    assert big[0].score == pytest.approx(1 / 61 + 1 / 63) and big[1].score == pytest.approx(2 / 62)


def test_window_cuts_each_list_before_fusing():
    lex = [(f"l{i}", 1.0) for i in range(10)]
    dense = [(f"d{i}", 1.0) for i in range(10)] + [("l0", 0.1)]
    hits = rrf_fuse({"lexical": lex, "dense": dense}, window=3)
    assert {h.docid for h in hits} == {"l0", "l1", "l2", "d0", "d1", "d2"}
    l0 = next(h for h in hits if h.docid == "l0")
    assert l0.ranks.keys() == {"lexical"}  # its dense rank 11 is outside the window


def test_ties_break_by_docid_and_limit():
    hits = rrf_fuse({"a": [("z", 1.0), ("m", 0.5)], "b": [("m", 1.0), ("z", 0.5)]}, limit=1)
    assert [h.docid for h in hits] == ["m"]  # equal scores: docid order


def test_duplicate_docids_in_one_list_count_once():
    hits = rrf_fuse({"a": [("x", 1.0), ("x", 0.9), ("y", 0.5)]}, k=60)
    assert hits[0].score == pytest.approx(1 / 61) and hits[1].score == pytest.approx(1 / 62)


def test_empty_and_invalid():
    assert rrf_fuse({}) == []
    assert rrf_fuse({"a": [], "b": []}) == []
    with pytest.raises(ValueError):
        rrf_fuse({"a": []}, window=0)
    with pytest.raises(ValueError):
        rrf_fuse({"a": []}, k=-1)


def test_single_ranking_keeps_the_retrievers_scores():
    hits = single_ranking("dense", [("a", 0.9), ("b", 0.5), ("c", 0.1)], limit=2)
    assert [(h.docid, h.score, h.ranks["dense"].rank) for h in hits] == [("a", 0.9, 1), ("b", 0.5, 2)]
