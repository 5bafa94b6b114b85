"""Several optimisation passes per iteration (`algorithm.epochs`) and masking of truncated
completions (`algorithm.mask_truncated`), checked against the same computation by hand."""

import pytest
import torch

from flexmarl.config.schema import AgentConfig
from flexmarl.orchestrator.episodes import truncated
from flexmarl.training import state as st
from flexmarl.training.trainer import AgentTrainer, Sample
from flexmarl.types import GenerationRequest

VOCAB = 22


def _cfg(**algo) -> AgentConfig:
    return AgentConfig.model_validate({
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                  "init_std": 0.1},
        "algorithm": {"name": "grpo", **algo},
        "optim": {"lr": 0.01},
    })


def _rows(version: int = 0, n: int = 6) -> list[Sample]:
    """Rows with made-up behaviour log-probs and advantages; ids out of order on purpose."""
    return [Sample(f"{version}-{i}_0_0", [1, 3, 2, 6 + i], [14 + i, 15], [-2.0 - 0.1 * i, -1.5],
                   1.0 if i % 2 else -1.0, None, 1.0, version, truncated=(i == 2))
            for i in reversed(range(n))]


def _weights(t: AgentTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def test_two_epochs_equal_a_second_step_over_the_same_rows_in_id_order():
    two = AgentTrainer("a", _cfg(epochs=2), VOCAB, 16, run_seed=0)
    rows = _rows()
    two.accumulate(rows[:3])
    two.accumulate(rows[3:])
    metrics = two.step()
    assert metrics["epochs"] == 2.0 and two.version == 1
    assert 0.0 <= metrics["clip_frac_last_epoch"] <= 1.0

    # by hand: one pass, step; the same rows again (sorted by id, one chunk), step
    by_hand = AgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0, max_staleness=1)
    by_hand.accumulate(rows[:3])
    by_hand.accumulate(rows[3:])
    by_hand.step()
    by_hand.accumulate(sorted(rows, key=lambda s: s.sample_id))
    by_hand.step()
    got, want = _weights(two), _weights(by_hand)
    assert all(torch.equal(got[k], want[k]) for k in want)
    one = AgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0)
    one.accumulate(rows)
    one.step()
    assert any(not torch.equal(got[k], v) for k, v in _weights(one).items())


def test_kept_rows_travel_with_a_swap_between_micro_batches():
    rows = _rows()
    plain = AgentTrainer("a", _cfg(epochs=3), VOCAB, 16, run_seed=0)
    plain.accumulate(rows[:3])
    plain.accumulate(rows[3:])
    plain.step()

    swapped = AgentTrainer("a", _cfg(epochs=3), VOCAB, 16, run_seed=0)
    swapped.accumulate(rows[:3])
    saved = st.from_wire(st.to_wire(swapped.capture()))  # the bytes a swap moves
    fresh = AgentTrainer("a", _cfg(epochs=3), VOCAB, 16, run_seed=0)
    fresh.restore(saved)
    assert [s.sample_id for s in fresh._kept] == [s.sample_id for s in rows[:3]]
    fresh.accumulate(rows[3:])
    fresh.step()
    got, want = _weights(fresh), _weights(plain)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_mask_truncated_leaves_cut_rows_out_of_loss_and_normalisation():
    rows = _rows()
    masked = AgentTrainer("a", _cfg(mask_truncated=True), VOCAB, 16, run_seed=0)
    masked.accumulate(rows)
    metrics = masked.step()
    assert metrics["rows"] == 5.0 and metrics["rows_masked_truncated"] == 1.0

    kept_only = AgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0)
    kept_only.accumulate([s for s in rows if not s.truncated])
    kept_only.step()
    got, want = _weights(masked), _weights(kept_only)
    assert all(torch.equal(got[k], want[k]) for k in want)

    unmasked = AgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0)
    unmasked.accumulate(rows)
    assert unmasked.step()["rows"] == 6.0


def test_an_iteration_of_only_truncated_rows_skips_its_step():
    t = AgentTrainer("a", _cfg(mask_truncated=True), VOCAB, 16, run_seed=0)
    before = _weights(t)
    t.accumulate([s for s in _rows() if s.truncated])
    metrics = t.step()
    assert metrics["skipped"] == 1.0 and metrics["rows_masked_truncated"] == 1.0
    assert t.version == 1 and all(torch.equal(before[k], v) for k, v in _weights(t).items())


@pytest.mark.parametrize("tokens,stops,stop_text,budget,cut", [
    ([5, 6, 7], [2], [], 3, True),     # budget used, no stop token: cut
    ([5, 6, 2], [2], [], 3, False),    # ended on its stop token at the budget
    ([5, 2], [2], [], 3, False),       # stopped early
    ([5, 6, 7], [], [], 3, False),     # no stop condition: the budget is the length
    ([5, 6, 7], [], ["\n"], 3, True),  # a text node whose stop string never came
])
def test_truncated_means_the_budget_not_the_model_ended_it(tokens, stops, stop_text, budget,
                                                           cut):
    req = GenerationRequest("0-0_0_0", "a", 0, [1], budget, stop_tokens=stops, stop=stop_text)
    assert truncated(req, tokens) is cut
