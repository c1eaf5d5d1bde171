"""The reference engine's ranks, both ways they start: forked (a CPU, what `./check.sh p06` checks) and started
afresh (what GPUs need, since CUDA cannot run in a forked process). Only the CPU runs here, so the fresh
start is forced: its child imports the folder again, gets the model through shared memory, and must give
the tokens of the engine on one rank."""

import pytest
import torch

from checks.harness.loader import named
from checks.harness.oracles import ModelWeights

PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33], [5, 17, 3, 88, 41, 9, 60, 2, 71, 12], [90, 1, 44, 7]]


@pytest.fixture(scope="module")
def engine():
    return named("solutions").load_to_time("p06_engine")


def tokens(engine, tp: int) -> list[list[int]]:
    w = ModelWeights.random(torch.Generator().manual_seed(3), 96, 48, 80, 2, 4, 2, 16).to(torch.float16)
    config = engine.EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=8, max_num_seqs=8,
                                 max_model_len=64, cuda_graphs=False, tensor_parallel_size=tp)
    llm = engine.LLM(w, config)
    try:
        return llm.generate(PROMPTS, engine.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    finally:
        llm.close()


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_two_ranks_give_the_tokens_of_one(engine, monkeypatch, start):
    one = tokens(engine, 1)
    monkeypatch.setattr(engine.TensorParallel, "_start_method", lambda self: start)
    assert tokens(engine, 2) == one
