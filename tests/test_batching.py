"""Batching: the contiguous split, longest-first microbatches, padding, W_k."""

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


def test_split_is_contiguous_per_worker_and_recorded():
    row = [7, 3, 9, 1, 4, 8]
    assert batching.local_slice(row, 0, 2) == [7, 3, 9]
    assert batching.local_slice(row, 1, 2) == [1, 4, 8]
    assert batching.local_slice(row, 0, 1) == row
    assert batching.assignment([row, row[::-1]], 2) == [[[7, 3, 9], [1, 4, 8]], [[8, 4, 1], [9, 3, 7]]]
    with pytest.raises(ValueError, match="does not split"):
        batching.local_slice(row, 0, 4)


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
    assert plan0.local == [0, 1] and plan0.microbatches == [[0], [1]]
    assert plan1.local == [2, 3] and plan1.microbatches == [[2], [3]]
    expected = 3 * 8 + 8 * 1 + 1 * 8 + 5 * 1
    assert plan0.total_weight == plan1.total_weight == expected


def test_collate_pads_to_the_longest_document_of_the_microbatch_only():
    mb = batching.collate([doc(5, 8.0), doc(2, 1.0)], weight_dtype=torch.float64, pad_id=0)
    assert mb.input_ids.shape == (2, 5)
    assert mb.input_ids[1].tolist() == [1, 2, 0, 0, 0]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert mb.weights.dtype == torch.float64
    assert mb.weights.tolist() == [[0, 8, 8, 8, 8], [0, 1, 0, 0, 0]]
    assert mb.tokens == 7


def test_collate_refuses_a_document_whose_weights_do_not_match_its_tokens():
    with pytest.raises(ValueError, match="3 tokens but 2 weights"):
        batching.collate([Doc((1, 2, 3), (0.0, 1.0))])


def test_padding_efficiency_of_a_schedule_sorted_and_unsorted():
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
    # documents to 50 and leaves the longest alone (3*50 + 192), where longest
    # first would pad three rows to 192 (3*192 + 30).
    partial = batching.padding_efficiency([192, 50, 40, 30], [[0, 1, 2, 3]], 1, 3)
    assert partial.computed_tokens == 3 * 50 + 192
