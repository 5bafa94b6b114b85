"""The cost model: hand-computed cases, monotonicity, continuous batching, length sampling."""

from __future__ import annotations

import numpy as np
import pytest

from flexmarl.sim.cost import CostModel, Efficiency
from flexmarl.sim.hardware import get_accelerator
from flexmarl.sim.lengths import LengthDistribution
from flexmarl.sim.models import MODEL_PRESETS, ModelSpec, UnknownModelError, get_model

H800 = get_accelerator("H800")
M7 = get_model("7B")

# A cost model with every factor pinned, so the hand arithmetic below does not move when the
# defaults are recalibrated.
PINNED = CostModel(
    H800,
    efficiency=Efficiency(
        mfu_prefill=0.5, mbu_decode=0.7, mfu_decode=0.5, mfu_train=0.4, mbu_optimizer=0.7),
    decode_step_overhead_s=1e-3,
    allreduce_latency_s=20e-6,
)


# --- models -------------------------------------------------------------------------------------


def test_presets_cover_the_qwen_sizes() -> None:
    sizes = ["0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B"]
    specs = [get_model(s) for s in sizes]
    assert len(MODEL_PRESETS) == 7
    assert [s.params for s in specs] == sorted(s.params for s in specs)
    assert get_model("qwen2.5-72b") is get_model("72b")
    # Qwen2.5-7B: 28 layers, 4 KV heads of 128 -> 2 * 28 * 4 * 128 * 2 bytes per token.
    assert M7.kv_bytes_per_token == 57_344
    assert M7.weight_bytes == pytest.approx(7.61e9 * 2)


def test_unknown_model_lists_presets() -> None:
    with pytest.raises(UnknownModelError, match="qwen2.5-7b"):
        get_model("13B")


def test_custom_model_spec() -> None:
    custom = ModelSpec(name="mine", params=1e9, layers=16, hidden=2048, kv_heads=4, head_dim=64)
    assert custom.kv_bytes_per_token == 2 * 16 * 4 * 64 * 2
    with pytest.raises(ValueError):
        ModelSpec(params=-1, layers=1, hidden=1, kv_heads=1, head_dim=1)


# --- hand-computed cases ------------------------------------------------------------------------


def test_decode_step_hand_computed() -> None:
    # 7B on one H800, batch 1 with 1000 tokens of KV cache:
    #   weights  7.61e9 params * 2 B       = 15.22e9 B
    #   KV       1000 tokens * 57,344 B     =  0.057344e9 B
    #   memory   15.277344e9 B / (3.35e12 B/s * 0.7) = 6.5149e-3 s
    #   compute  2 * 7.61e9 * 1 / (989.5e12 * 0.5)   = 3.08e-5 s  (memory-bound)
    #   + step overhead 1e-3 s, no TP all-reduce at tp=1  -> 7.5149e-3 s
    expected = 15.277344e9 / (3.35e12 * 0.7) + 1e-3
    assert PINNED.decode_step_time(M7, 1, 1, 1000) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(7.5149e-3, rel=1e-4)


def test_prefill_hand_computed() -> None:
    # 7B, 2048 prompt tokens on one H800: 2 * 7.61e9 * 2048 / (989.5e12 * 0.5) = 0.063001 s,
    # more than reading the weights once (15.22e9 / 2.345e12 = 0.00649 s), + 1 ms overhead.
    expected = 2 * 7.61e9 * 2048 / (989.5e12 * 0.5) + 1e-3
    assert PINNED.prefill_time(M7, 1, 2048) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.064001, rel=1e-4)


def test_train_time_hand_computed() -> None:
    # 7B over 1M tokens on 8 H800s: 6 * 7.61e9 * 1e6 / (8 * 989.5e12 * 0.4)
    #   = 4.566e16 / 3.1664e15 = 14.4202 s.
    # Optimizer step: Adam 7.61e9 * 30 B / (8 * 3.35e12 * 0.7) = 0.012170 s, plus the ring
    # all-reduce of BF16 grads 2 * 7/8 * 15.22e9 B / (200e9 * 0.8 B/s) = 0.166469 s, plus
    # 28 layers * 10 us latency = 0.00028 s.
    compute = 6 * 7.61e9 * 1e6 / (8 * 989.5e12 * 0.4)
    optimizer = 7.61e9 * 30 / (8 * 3.35e12 * 0.7) + 2 * 7 / 8 * 15.22e9 / (200e9 * 0.8) + 28e-5
    assert PINNED.train_compute_time(M7, 8, 1e6) == pytest.approx(compute, rel=1e-12)
    assert PINNED.optimizer_step_time(M7, 8) == pytest.approx(optimizer, rel=1e-12)
    assert compute == pytest.approx(14.4202, rel=1e-4)


def test_old_policy_and_reference_forwards_hand_computed() -> None:
    # GRPO's two extra forward passes over the same 1M tokens on 8 H800s: each
    # 2 * 7.61e9 * 1e6 / (8 * 989.5e12 * 0.4) = 1.5220e16 / 3.1664e15 = 4.8067 s, so the
    # micro-batch's compute grows from 6 to 6 + 2 * 2 = 10 x params x tokens
    one = 2 * 7.61e9 * 1e6 / (8 * 989.5e12 * 0.4)
    assert one == pytest.approx(4.8067, rel=1e-4)
    assert PINNED.policy_forwards_time(M7, 8, 1e6, 2) == pytest.approx(2 * one, rel=1e-12)
    assert PINNED.policy_forwards_time(M7, 8, 1e6, 0) == 0.0
    total = PINNED.train_compute_time(M7, 8, 1e6) + PINNED.policy_forwards_time(M7, 8, 1e6, 2)
    assert total == pytest.approx(10 / 6 * PINNED.train_compute_time(M7, 8, 1e6), rel=1e-12)


def test_weight_transfer_hand_computed() -> None:
    # 15.22e9 B of 7B weights across nodes: 50e9 B/s * 0.9 = 45e9 B/s -> 0.338222 s, plus one
    # 20 us latency per layer bucket (28 layers) = 0.00056 s.
    expected = 15.22e9 / 45e9 + 28 * 20e-6
    assert PINNED.weight_transfer_time(M7, inter_node=True) == pytest.approx(expected, rel=1e-12)
    # Inside a node NVLink carries 400/2 GB/s * 0.8 = 160 GB/s, split over 2 links.
    intra = 15.22e9 / 2 / 160e9 + 28 * 10e-6
    assert PINNED.weight_transfer_time(M7, inter_node=False, links=2) == pytest.approx(intra)


def test_colocated_baseline_costs() -> None:
    # Sleep: 15.22e9 B over PCIe Gen5 at 64e9 * 0.8 B/s = 0.297266 s + 0.5 s fixed.
    assert PINNED.engine_sleep_time(M7, 1) == pytest.approx(15.22e9 / 51.2e9 + 0.5)
    assert PINNED.engine_wake_time(M7, 1) > PINNED.engine_sleep_time(M7, 1)
    assert PINNED.engine_wake_time(M7, 1, kv_bytes=10e9) > PINNED.engine_wake_time(M7, 1)
    # 16 B/param of training state, sharded over 8 devices, one way over PCIe.
    assert PINNED.train_state_swap_time(M7, 8) == pytest.approx(7.61e9 * 16 / 8 / 51.2e9)


# --- monotonicity -------------------------------------------------------------------------------


def test_decode_monotone_in_batch_kv_and_model_size() -> None:
    cm = CostModel(H800)
    steps = [cm.decode_step_time(M7, 1, b, 1000 * b) for b in (1, 8, 64, 256, 1024)]
    assert steps == sorted(steps) and steps[0] < steps[-1]
    kv = [cm.decode_step_time(M7, 1, 16, t) for t in (0, 1e4, 1e5, 1e6)]
    assert kv == sorted(kv) and kv[0] < kv[-1]
    by_size = [cm.decode_step_time(m, 8, 8, 8000) for m in MODEL_PRESETS.values()]
    assert by_size == sorted(by_size)


def test_prefill_and_training_monotone_in_tokens_and_size() -> None:
    cm = CostModel(H800)
    pre = [cm.prefill_time(M7, 1, t) for t in (1, 1000, 10_000, 100_000)]
    assert pre == sorted(pre) and pre[0] < pre[-1]
    train = [cm.train_compute_time(M7, 8, t) for t in (1e3, 1e5, 1e7)]
    assert train == sorted(train) and train[0] < train[-1]
    sizes = [cm.train_compute_time(m, 16, 1e6) + cm.optimizer_step_time(m, 16)
             for m in MODEL_PRESETS.values()]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_generation_monotone_in_tokens_batch_and_size() -> None:
    cm = CostModel(H800)
    outs = [cm.generation_timing(M7, 1, 512, [n] * 32).total_s for n in (16, 128, 1024)]
    assert outs == sorted(outs) and outs[0] < outs[-1]
    batches = [cm.generation_timing(M7, 1, 512, [256] * b).total_s for b in (1, 16, 256, 1024)]
    assert batches == sorted(batches) and batches[0] < batches[-1]
    sizes = [cm.generation_timing(m, 8, 512, [256] * 64).total_s for m in MODEL_PRESETS.values()]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_tensor_parallelism_speeds_up_a_big_model() -> None:
    cm = CostModel(H800)
    m72 = get_model("72B")
    by_tp = [cm.generation_timing(m72, tp, 512, [512] * 64).total_s for tp in (4, 8)]
    assert by_tp == sorted(by_tp, reverse=True)
    # 145 GB of weights do not fit one 80 GB GPU, nor two at 90% memory (72.7 GB > 72 GB).
    assert cm.kv_capacity_tokens(m72, 1) == cm.kv_capacity_tokens(m72, 2) == 0


# --- continuous batching ------------------------------------------------------------------------


def _reference_timeline(
    cm: CostModel, model: ModelSpec, tp: int, prompts: list[int], outs: list[int], cap: int
) -> tuple[float, list[float]]:
    """Step-by-step simulation of the same continuous-batching rules (slow, obviously right)."""
    waiting = list(range(len(outs)))
    running: dict[int, int] = {}  # sequence -> tokens generated so far
    finish = [0.0] * len(outs)
    t = 0.0
    while waiting or running:
        batch = []
        while waiting and len(running) + len(batch) < cap:
            batch.append(waiting.pop(0))
        if batch:
            t += cm.prefill_time(model, tp, sum(prompts[i] for i in batch))
            for i in batch:
                if outs[i] == 1:
                    finish[i] = t
                else:
                    running[i] = 1
            if not running:
                continue
        kv = sum(prompts[i] + running[i] for i in running)
        t += cm.decode_step_time(model, tp, len(running), kv)
        for i in list(running):
            running[i] += 1
            if running[i] == outs[i]:
                finish[i] = t
                del running[i]
    return t, finish


@pytest.mark.parametrize("cap", [1, 3, 64])
def test_closed_form_matches_step_by_step_reference(cap: int) -> None:
    cm = CostModel(H800)
    rng = np.random.default_rng(7)
    outs = [int(x) for x in rng.integers(1, 120, size=10)]
    prompts = [int(x) for x in rng.integers(0, 300, size=10)]
    timing = cm.generation_timing(M7, 2, prompts, outs, max_num_seqs=cap)
    total, finish = _reference_timeline(cm, M7, 2, prompts, outs, cap)
    assert timing.total_s == pytest.approx(total, rel=1e-9)
    np.testing.assert_allclose(timing.finish_s, finish, rtol=1e-9)
    assert timing.total_s == pytest.approx(timing.prefill_s + timing.decode_s)
    assert timing.peak_batch <= cap


def test_closed_form_matches_reference_in_compute_bound_regime() -> None:
    # A tiny decode MFU makes large batches compute-bound, exercising the roofline's other side.
    cm = CostModel(H800, efficiency=Efficiency(mfu_decode=0.01))
    outs = [40, 80, 80, 120] * 8
    total, finish = _reference_timeline(cm, M7, 1, [64] * 32, outs, 256)
    timing = cm.generation_timing(M7, 1, 64, outs)
    assert timing.total_s == pytest.approx(total, rel=1e-9)
    np.testing.assert_allclose(timing.finish_s, finish, rtol=1e-9)


def test_batch_shrinks_as_sequences_finish() -> None:
    cm = CostModel(H800)
    # One long straggler among short sequences: once the short ones finish, the straggler
    # decodes alone, each step then costing what a batch of one costs.
    mixed = cm.generation_timing(M7, 1, 256, [64] * 63 + [4096])
    assert mixed.decode_steps == 4095
    short_done = mixed.finish_s[:63].max()
    assert short_done < mixed.finish_s[63] == mixed.total_s
    alone = sum(cm.decode_step_time(M7, 1, 1, 256 + k) for k in range(64, 4096))
    assert mixed.total_s - short_done == pytest.approx(alone, rel=1e-9)
    # Decode is memory-bound on the weights: the straggler, not the batch, sets the time.
    all_long = cm.generation_timing(M7, 1, 256, [4096] * 64).total_s
    single = cm.generation_timing(M7, 1, 256, [4096]).total_s
    assert single < mixed.total_s < all_long < 2 * single


def test_kv_capacity_limits_concurrency() -> None:
    cm = CostModel(get_accelerator("A100-80G"))
    m32 = get_model("32B")
    cap = cm.kv_capacity_tokens(m32, 1)
    per_seq = 8192 + 8192
    timing = cm.generation_timing(m32, 1, 8192, [8192] * 16)
    assert timing.peak_batch == cap // per_seq < 16
    with pytest.raises(ValueError, match="KV tokens"):
        cm.generation_timing(m32, 1, cap, [10])


def test_bad_arguments_are_rejected() -> None:
    cm = CostModel(H800)
    with pytest.raises(ValueError, match="tp"):
        cm.decode_step_time(M7, 16, 1, 0)
    with pytest.raises(ValueError):
        cm.generation_timing(M7, 1, 10, [0, 5])
    with pytest.raises(ValueError, match="mbu_decode"):
        Efficiency(mbu_decode=1.5)
    assert CostModel.named("h800") == CostModel(H800)


# --- length distributions -----------------------------------------------------------------------

DISTRIBUTIONS = [
    LengthDistribution(kind="fixed", mean=300),
    LengthDistribution(kind="uniform", mean=300, spread=0.5),
    LengthDistribution(kind="lognormal", mean=300, sigma=1.0, max=20_000),
    LengthDistribution(kind="pareto", mean=300, alpha=1.5, max=20_000),
]


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=lambda d: d.kind)
def test_sampling_is_deterministic_and_clipped(dist: LengthDistribution) -> None:
    a = dist.sample(np.random.default_rng(123), 5000)
    b = dist.sample(np.random.default_rng(123), 5000)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int64
    assert a.min() >= dist.min and a.max() <= dist.upper
    assert abs(a.mean() - 300) < 0.15 * 300  # the mean holds (clipping trims a little)


@pytest.mark.parametrize("dist", DISTRIBUTIONS[2:], ids=lambda d: d.kind)
def test_long_tail_is_actually_long(dist: LengthDistribution) -> None:
    x = dist.sample(np.random.default_rng(0), 20_000)
    ratio = np.percentile(x, 99) / np.median(x)
    # lognormal sigma=1: exp(2.326) ~ 10.2; pareto alpha=1.5: (0.01/0.5)^(-1/1.5) ~ 13.6.
    assert ratio > 8


def test_uniform_and_fixed_have_no_tail() -> None:
    for dist in DISTRIBUTIONS[:2]:
        x = dist.sample(np.random.default_rng(0), 5000)
        assert np.percentile(x, 99) / np.median(x) < 1.6


def test_length_distribution_validation_and_helpers() -> None:
    assert LengthDistribution.model_validate(512) == LengthDistribution(kind="fixed", mean=512)
    with pytest.raises(ValueError, match="alpha"):
        LengthDistribution(kind="pareto", mean=100, alpha=0.9)
    with pytest.raises(ValueError, match="sigma only applies"):
        LengthDistribution(kind="pareto", mean=100, sigma=1.0)
    with pytest.raises(ValueError, match="below min"):
        LengthDistribution(kind="lognormal", mean=100, min=50, max=10)
    skewed = LengthDistribution(kind="lognormal", mean=100, sigma=0.5, max=1000).scaled(4)
    assert (skewed.mean, skewed.max) == (400, 4000)
    assert LengthDistribution(kind="fixed", mean=7).sample(np.random.default_rng(0)) == 7


def test_reference_oracle_by_hand() -> None:
    # Guard the oracle itself on a case small enough to do by hand: one sequence, 3 tokens:
    # prefill makes token 1, two decode steps (KV 11 then 12) make tokens 2 and 3.
    cm = PINNED
    total, finish = _reference_timeline(cm, M7, 1, [10], [3], 8)
    hand = (
        cm.prefill_time(M7, 1, 10)
        + cm.decode_step_time(M7, 1, 1, 11)
        + cm.decode_step_time(M7, 1, 1, 12)
    )
    assert total == pytest.approx(hand) and finish == [total]
    assert PINNED.generation_timing(M7, 1, 10, [3]).total_s == pytest.approx(hand)
