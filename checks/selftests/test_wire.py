"""What crosses to the worker arrives as the check gave it: one object given twice in a call (one SamplingParams
for two prompts in a list) is one object in the learner's code too, and two equal objects stay two; a tuple stays a
tuple and a range a range."""

from types import SimpleNamespace

import pytest

from checks.harness import wire
from checks.harness.guard import ParentCodec
from checks.harness.serve import WorkerCodec


class Params:
    def __init__(self, seed: int):
        self.seed = seed


def test_an_object_given_twice_in_a_call_arrives_as_one_object():
    p, q = Params(7), Params(7)
    codec = ParentCodec(SimpleNamespace(callbacks=[]))
    tree = codec.encode(([p, q, p], {"params": p}))
    (first, other, again), named = WorkerCodec(SimpleNamespace()).decode(tree, codec.storages)
    assert first is again is named["params"]
    assert first is not other and (first.seed, other.seed) == (7, 7)
    assert type(first).__name__ == "Params"


def test_a_reference_to_an_object_not_sent_is_refused():
    with pytest.raises(wire.WireError):
        WorkerCodec(SimpleNamespace()).decode(("L", [("OR", 0)]), [])


def test_a_tuple_and_a_range_arrive_as_such():
    codec = ParentCodec(SimpleNamespace(callbacks=[]))
    tree = codec.encode([(1, 2, 3), range(1, 7, 2)])
    sent, stepped = WorkerCodec(SimpleNamespace()).decode(tree, codec.storages)
    assert (type(sent), sent) == (tuple, (1, 2, 3)) and (type(stepped), stepped) == (range, range(1, 7, 2))


@pytest.mark.parametrize("node", [("RG", 0, 5, 0), ("RG", 0, "5", 1), ("RG", 0, 5)])
def test_a_range_that_is_not_one_is_refused(node):
    with pytest.raises(wire.WireError):
        WorkerCodec(SimpleNamespace()).decode(node, [])
