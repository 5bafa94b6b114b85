"""A micro-batch split by length (`length_split`): the cheapest split, and the same step as the
whole micro-batch padded to its longest row."""

import itertools

import numpy as np
import pytest
import torch

from flexmarl.config.schema import AgentConfig
from flexmarl.training.trainer import AgentTrainer, length_split
from flexmarl.types import Sample

VOCAB = 32


def _cost(lengths: list[int], runs: list[list[int]], call: int) -> int:
    return sum(call + len(r) * max(lengths[i] for i in r) for r in runs)


def _brute_force(lengths: list[int], call: int) -> int:
    """The cheapest cost over every cut of the sorted rows into contiguous runs."""
    s = sorted(lengths)
    best = None
    for k in range(len(s)):
        for cuts in itertools.combinations(range(1, len(s)), k):
            edges = [0, *cuts, len(s)]
            cost = sum(call + (b - a) * s[b - 1] for a, b in itertools.pairwise(edges))
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_split_is_the_cheapest_cut_of_the_sorted_rows(seed):
    rng = np.random.default_rng(seed)
    lengths = [int(v) for v in np.minimum(128, np.maximum(1, rng.lognormal(3.0, 1.0, size=9)))]
    for call in (1, 16, 64, 400):
        runs = length_split(lengths, call)
        assert sorted(i for r in runs for i in r) == list(range(len(lengths)))
        assert _cost(lengths, runs, call) == _brute_force(lengths, call)
    assert len(length_split(lengths, 10_000)) == 1  # a call costs more than any padding
    assert length_split(lengths, 0) == [sorted(range(9), key=lambda i: (lengths[i], i))]
    assert length_split([], 64) == []


def test_a_long_tail_splits_and_equal_lengths_do_not():
    assert len(length_split([10] * 15 + [120], 64)) == 2  # the long row alone
    assert length_split([10] * 16, 64) == [list(range(16))]


def _agent(name: str, split: int | None, **algo) -> AgentConfig:
    return AgentConfig.model_validate({
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2,
                  "split_call_tokens": split},
        "algorithm": {"name": name, **algo},
        "optim": {"lr": 0.01},
    })


def _rows() -> list[Sample]:
    rng = np.random.default_rng(1)
    rows = []
    for i, n in enumerate([2, 3, 3, 4, 5, 40, 60, 3]):  # a long tail of two rows
        rows.append(Sample(f"0-{i}_0_0", [1, *rng.integers(4, VOCAB, size=5).tolist()],
                           rng.integers(4, VOCAB, size=n).tolist(),
                           (-rng.random(n) * 3).tolist(), float(rng.normal()), None, 1.0, 0))
    return rows


@pytest.mark.parametrize("algo", [{"name": "grpo", "entropy_coef": 0.01},
                                  {"name": "ppo", "whiten_advantages": False}])
def test_a_split_micro_batch_steps_as_the_whole_one(algo):
    name = algo.pop("name")
    out = {}
    for split in (0, 8):
        trainer = AgentTrainer("a", _agent(name, split, **algo), VOCAB, 80, run_seed=0)
        calls = []
        whole = trainer._backward_batch
        trainer._backward_batch = lambda s, f, w=whole, c=calls: (c.append(len(s)), w(s, f))[1]
        trainer.accumulate(_rows())
        grads = [p.grad.clone() for p in trainer.params]
        out[split] = (calls, trainer.step(), grads)
    assert out[0][0] == [8] and len(out[8][0]) > 1 and sum(out[8][0]) == 8
    for key in ("loss/policy", "kl", "entropy", "clip_frac", "grad_norm", "loss/value"):
        assert out[8][1][key] == pytest.approx(out[0][1][key], rel=1e-5, abs=1e-6), key
    for split_grad, whole_grad in zip(out[8][2], out[0][2], strict=True):
        torch.testing.assert_close(split_grad, whole_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("algo", [{"name": "ppo"}, {"name": "reinforce_pp"}])
def test_batch_statistics_keep_the_micro_batch_whole(algo):
    """Whitening over the micro-batch's tokens: a split would change the loss."""
    trainer = AgentTrainer("a", _agent(algo["name"], 8), VOCAB, 80, run_seed=0)
    assert trainer.split_call_tokens == 0
    calls = []
    whole = trainer._backward_batch
    trainer._backward_batch = lambda s, f: (calls.append(len(s)), whole(s, f))[1]
    trainer.accumulate(_rows())
    assert calls == [8]


def test_the_default_on_cpu_splits_a_long_tail():
    trainer = AgentTrainer("a", _agent("grpo", None), VOCAB, 80, run_seed=0)
    assert trainer.split_call_tokens == 64
    assert len(length_split([len(s.prompt) + len(s.response) for s in _rows()], 64)) > 1
