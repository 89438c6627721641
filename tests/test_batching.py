"""Batching: the work-balanced split, shortest-first microbatches, packing, W_k."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from coopstudy.numerics import batching


@dataclass(frozen=True)
class Doc:
    input_ids: tuple[int, ...]
    weights: tuple[float, ...]


def doc(n: int, weight: float = 1.0) -> Doc:
    return Doc(tuple(range(1, n + 1)), (0.0,) + (weight,) * (n - 1))


def test_split_balances_work_and_gives_every_worker_a_document():
    work = {7: 60, 3: 50, 9: 40, 1: 30, 4: 20, 8: 10}
    row = [7, 3, 9, 1, 4, 8]
    # Contiguous halves would hold 150 and 60; these 110 and 100, each in schedule order.
    assert batching.shares(row, work, 2) == [[7, 1, 4], [3, 9, 8]]
    assert batching.shares(row, work, 1) == [row]
    # The greedy fill alone leaves 23 and 18 (10 7 6 | 9 8 1); swapping 10 and 8 evens it to 21 and 20.
    assert batching.shares(list(range(6)), [10, 9, 8, 7, 6, 1], 2) == [[2, 3, 4], [0, 1, 5]]
    # Counts follow the work: one long document against seven short ones (contiguous: 130 and 40).
    assert batching.shares(list(range(8)), [100] + [10] * 7, 2) == [[0], [1, 2, 3, 4, 5, 6, 7]]
    # Every worker holds a document, however uneven.
    assert batching.shares([0, 1, 2], [1000, 1, 1], 3) == [[0], [1], [2]]
    assert batching.assignment([row, row[:2]], work, 2) == [[[7, 1, 4], [3, 9, 8]], [[7], [3]]]
    with pytest.raises(ValueError, match="does not split"):
        batching.shares(row[:2], work, 3)


def test_local_batch_is_sorted_shortest_first_and_the_last_microbatch_is_partial():
    lengths = {10: 5, 11: 40, 12: 12, 13: 40, 14: 3, 15: 12}
    cut = batching.sort_and_cut([10, 11, 12, 13, 14, 15], lengths, 4)
    # Equal lengths keep schedule order (12 before 15, 11 before 13); the
    # partial last microbatch holds the longest documents.
    assert cut == [[14, 10, 12, 15], [11, 13]]
    assert batching.sort_and_cut([10, 11, 12, 13, 14], lengths, 2) == [[14, 10], [12, 11], [13]]
    assert batching.sort_and_cut([10, 11, 12, 13, 14], lengths, 2, sort=False) == [[10, 11], [12, 13], [14]]


def test_plan_uses_only_this_workers_documents_but_the_global_weight():
    docs = [doc(n, w) for n, w in [(4, 8.0), (9, 1.0), (2, 8.0), (6, 1.0)]]
    row = [0, 1, 2, 3]
    plan0 = batching.plan_update(docs, row, 0, 2, 1)
    plan1 = batching.plan_update(docs, row, 1, 2, 1)
    # Shares of 11 and 10 tokens (9 + 2 | 4 + 6), each cut shortest first.
    assert plan0.local == [1, 2] and plan0.microbatches == [[2], [1]]
    assert plan1.local == [0, 3] and plan1.microbatches == [[0], [3]]
    expected = 3 * 8 + 8 * 1 + 1 * 8 + 5 * 1
    assert plan0.total_weight == plan1.total_weight == expected


def test_pack_puts_the_documents_in_one_row_with_their_own_positions_and_no_padding():
    mb = batching.pack([doc(5, 8.0), doc(2, 1.0), doc(1, 1.0)], weight_dtype=torch.float64)
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 1, 2, 1]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0]]
    assert mb.bounds == (0, 5, 7, 8) and mb.documents == 3
    assert mb.weights.dtype == torch.float64
    assert mb.weights.tolist() == [[0, 8, 8, 8, 8, 0, 1, 0]]
    assert mb.tokens == 8 == mb.input_ids.numel()


def test_pack_zeroes_every_documents_first_weight():
    # Position 0 is never a target; packed, it would be predicted from the
    # previous document's last token.
    mb = batching.pack([Doc((4, 5, 6), (3.0, 1.0, 1.0)), Doc((7,), (8.0,)), Doc((8, 9), (5.0, 8.0))])
    assert mb.weights.tolist() == [[0, 1, 1, 0, 0, 8]]


def test_pack_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="3 tokens but 2 weights"):
        batching.pack([Doc((1, 2, 3), (0.0, 1.0))])
    with pytest.raises(ValueError, match="empty document"):
        batching.pack([Doc((), ())])
    with pytest.raises(ValueError, match="at least one document"):
        batching.pack([])


def test_total_weight_counts_targets_only():
    # A first token's weight is never a target's: it counts in no W_k.
    docs = [Doc((1, 2, 3), (5.0, 1.0, 8.0)), Doc((4,), (8.0,))]
    assert batching.total_weight(docs, [0, 1]) == 9.0


def test_padding_efficiency_is_what_padding_would_cost():
    # Alternating long and short documents: unsorted microbatches of 2 pair a
    # long with a short one; sorted, equal lengths share a microbatch.
    lengths = [100, 10, 100, 10, 100, 10, 100, 10]
    schedule = [[0, 1, 2, 3, 4, 5, 6, 7]]
    unsorted = batching.padding_efficiency(lengths, schedule, 1, 2, sort=False)
    sorted_ = batching.padding_efficiency(lengths, schedule, 1, 2)
    assert unsorted.real_tokens == sorted_.real_tokens == 440
    assert unsorted.computed_tokens == 800 and unsorted.ratio == pytest.approx(0.55)
    assert sorted_.computed_tokens == 440 and sorted_.ratio == 1.0
    # Two workers: each sorts only its own half.
    two = batching.padding_efficiency([100, 100, 10, 10, 100, 10, 100, 10], schedule, 2, 2)
    assert two.computed_tokens == 20 + 200 + 20 + 200
    # A partial microbatch: 3 + 1 documents. Shortest first pads three short
    # documents to 50 and leaves the longest alone (3*50 + 192).
    partial = batching.padding_efficiency([192, 50, 40, 30], [[0, 1, 2, 3]], 1, 3)
    assert partial.computed_tokens == 3 * 50 + 192
