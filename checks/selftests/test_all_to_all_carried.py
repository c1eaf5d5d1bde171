"""The checks' process carries all_to_all and all_to_all_single between ranks (`ranks.combine`), and the mutants'
replays play them with threads (`simdist`): each rank gets, in rank order, the piece every rank sent it; a piece
that does not fit where a rank receives it is one error naming the rank to blame."""

import torch
import torch.distributed as dist

from checks.harness.ranks import combine
from checks.harness.simdist import run_ranks


def single(tensor, splits=None, out_rows=None, out_splits=None):
    rows = tensor.shape[0] if out_rows is None else out_rows
    return ("all_to_all_single", {"tensor": tensor, "splits": splits, "out_splits": out_splits,
                                  "out": ([rows, *tensor.shape[1:]], tensor.dtype)})


def test_all_to_all_single_with_splits():
    a, b = torch.arange(6.0).reshape(3, 2), 10 + torch.arange(4.0).reshape(2, 2)
    answers, culprits = combine([single(a, [1, 2], 3, [1, 2]), single(b, [2, 0], 2, [2, 0])])
    assert culprits == set()
    assert answers[0][0] == "collective-result" and torch.equal(answers[0][1], torch.cat([a[:1], b[:2]]))
    assert torch.equal(answers[1][1], a[1:])


def test_all_to_all_single_equal_parts_and_the_list_form():
    a, b = torch.arange(4.0), 10 + torch.arange(4.0)
    answers, _ = combine([single(a), single(b)])
    assert torch.equal(answers[0][1], torch.tensor([0.0, 1, 10, 11])) and torch.equal(answers[1][1],
                                                                                      torch.tensor([2.0, 3, 12, 13]))
    parts = [("all_to_all", {"tensors": [torch.full((r + 1,), 10.0 * s + r) for r in range(2)],
                             "outs": [([me + 1], torch.float32) for _ in range(2)]}) for s, me in ((0, 0), (1, 1))]
    answers, _ = combine(parts)
    assert [t.tolist() for t in answers[1][1]] == [[1.0, 1.0], [11.0, 11.0]]


def test_a_piece_that_does_not_fit_blames_its_rank():
    a, b = torch.zeros(3, 2), torch.zeros(2, 2)
    answers, culprits = combine([single(a, [1, 2], 3, [1, 2]), single(b, [2, 0], 2, [1, 1])])  # rank 1 expects 1 from 0
    assert culprits == {1}
    assert all(kind == "collective-error" for kind, _ in answers)
    assert "rank 0 sends rank 1 2 rows, rank 1 expects 1" in answers[1][1]
    answers, culprits = combine([single(a, [1, 1], 3), single(b, [1, 1], 2)])  # rank 0's splits miss a row
    assert culprits == {0} and "input_split_sizes [1, 1]" in answers[0][1]
    answers, culprits = combine([single(a), single(b)])  # 3 rows over 2 ranks, no splits
    assert culprits == {0} and "do not split equally" in answers[0][1]


def test_simdist_plays_both_forms():
    def exchange(x: torch.Tensor, send: list[int], receive: list[int]):
        out = x.new_empty(sum(receive), *x.shape[1:])
        dist.all_to_all_single(out, x, receive, send)
        pieces = [x.new_empty(1) for _ in range(dist.get_world_size())]
        dist.all_to_all(pieces, [x.new_full((1,), 100.0 * dist.get_rank() + r) for r in range(dist.get_world_size())])
        return out, torch.cat(pieces)

    a, b = torch.arange(3.0), 10 + torch.arange(2.0)
    (out0, list0), (out1, list1) = run_ranks(exchange, [(a, [1, 2], [1, 2]), (b, [2, 0], [2, 0])], 2)
    assert out0.tolist() == [0.0, 10.0, 11.0] and out1.tolist() == [1.0, 2.0]
    assert list0.tolist() == [0.0, 100.0] and list1.tolist() == [1.0, 101.0]
