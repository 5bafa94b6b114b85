"""End-to-end behaviour of the joint orchestrator on the local runtime (real worker processes,
real tiny transformers models)."""

from pathlib import Path

import pytest
from safetensors.torch import load_file

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _max_diff(a: Path, b: Path) -> float:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def _assert_exactly_once(result, cfg):
    """Every step k of every agent trained on exactly the rows of iteration k, once each, made
    by version k (max(0, k-1) in one_step_off)."""
    per_iteration = cfg.train.inputs_per_iteration * cfg.train.group_size
    lag = cfg.pipeline.max_staleness
    for agent, audit in result.audit.items():
        ids = [sid for sid, _, _ in audit]
        assert len(ids) == len(set(ids)), f"{agent}: a row was trained on twice"
        for sid, version, step in audit:
            assert version == max(0, step - lag), \
                f"{agent}: {sid} of version {version} used by step {step}"
            assert sid.startswith(f"{step}-"), f"{agent}: {sid} is not from iteration {step}"
        for k in range(cfg.train.iterations):
            failed = result.records[k]["episodes/failed"]
            assert len(result.consumed[agent][k]) == per_iteration - failed
        assert result.store_stats[agent]["ready"] == 0
        assert result.store_stats[agent]["pending"] == 0


def test_sync_and_async_give_equal_checkpoints_in_deterministic_mode(tmp_path):
    results = {}
    for mode in ("sync", "async"):
        cfg = load_config(EXAMPLES / "referential_game.yaml",
                          [f"pipeline.mode={mode}", "runtime.deterministic=true",
                           "train.iterations=3"])
        results[mode] = train(cfg, tmp_path / mode)
        _assert_exactly_once(results[mode], cfg)
    for agent, path in results["sync"].checkpoints.items():
        assert _max_diff(path, results["async"].checkpoints[agent]) <= 1e-5
    # and the runs really trained: weights moved away from the initial ones
    assert all(r["agent/speaker/grad_norm"] > 0 for r in results["async"].records)


def test_async_run_consumes_each_row_once_by_its_own_version(tmp_path):
    cfg = load_config(EXAMPLES / "relay_chain.yaml",
                      ["train.iterations=4", "train.micro_batch_size=16"])
    result = train(cfg, tmp_path / "run")
    _assert_exactly_once(result, cfg)
    last = result.records[-1]
    # rollout and trainer log-probs of the same weights agree (fp32 on the CPU), and every
    # worker says where it computes
    assert last["rollout/logprob_diff_mean"] < 1e-4
    assert last["rollout/logprob_diff_max"] < 1e-3
    for pool in ("rollout", "train"):
        assert [w["device"] for w in result.placement[pool]] == ["cpu"] * len(
            result.placement[pool])
    for agent in cfg.agents:
        assert last[f"agent/{agent}/policy_version"] == 4
    assert 0 < last["pool/rollout/busy_frac"] <= 1 and 0 < last["pool/train/busy_frac"] <= 1
    # the local pool's slot counters reach the records (`TrainPool.slot_counters`)
    assert last["pool/train/slot_wait_s"] >= 0 and "agent/relay/slot_wait_s" in last
    trace = (tmp_path / "run" / "trace.json").read_text()
    assert '"cat": "gen"' in trace and '"cat": "acc"' in trace and '"cat": "step"' in trace


def test_reward_that_raises_fails_only_its_episode(tmp_path):
    cfg = load_config(EXAMPLES / "referential_game.yaml", [
        "task.builder=tests.orchestrator.faulty_tasks:reward_raises_on_trajectory_zero",
        "train.iterations=2", "train.inputs_per_iteration=8",
    ])
    result = train(cfg, tmp_path / "run")
    assert [r["episodes/failed"] for r in result.records] == [1, 1]
    assert "judge crashed on purpose" in result.records[0]["errors"][0]
    for agent in ("speaker", "listener"):
        assert result.store_stats[agent]["failed"] == 2
    _assert_exactly_once(result, cfg)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2 and '"episodes/failed": 1' in metrics[0]


@pytest.mark.parametrize("example,iterations,threshold", [
    ("referential_game.yaml", 40, 0.6),
    # 31 s: the referential game keeps learning in `make test`
    pytest.param("relay_chain.yaml", 60, 0.5, marks=pytest.mark.slow),
])
def test_examples_learn_well_above_chance(tmp_path, example, iterations, threshold):
    cfg = load_config(EXAMPLES / example, [f"train.iterations={iterations}"])
    result = train(cfg, tmp_path / "run")
    first = sum(r["task/success_rate"] for r in result.records[:5]) / 5
    last = sum(r["task/success_rate"] for r in result.records[-5:]) / 5
    chance = 1 / cfg.task.options["num_candidates"]
    assert first < chance + 0.15
    assert last >= threshold, f"success {last:.3f} after {iterations} iterations"


def test_async_run_fails_clearly_when_the_task_returns_too_few_inputs(tmp_path):
    """A wrong input count in a later iteration fails the run (it used to hang)."""
    from flexmarl.graph.meg import GraphError

    cfg = load_config(EXAMPLES / "referential_game.yaml", [
        "task.builder=tests.orchestrator.faulty_tasks:short_inputs_from_iteration_one",
        "train.iterations=3", "train.inputs_per_iteration=8", "pipeline.mode=async",
    ])
    with pytest.raises(GraphError, match="task returned 7 inputs, expected 8"):
        train(cfg, tmp_path / "run")


@pytest.mark.slow  # about 55 s on 2 loaded cores; the fast split test is in test_losses
def test_policy_gradient_variants_keep_sync_and_async_equal(tmp_path):
    """clip-higher, Dr. GRPO aggregation and GSPO ratios are per-row losses, so the async
    pipeline's micro-batch accumulation still equals the sync step."""
    variants = ["agents.speaker.algorithm.clip_eps_high=0.28",
                "agents.speaker.algorithm.loss_agg=token_sum_norm",
                "agents.speaker.algorithm.loss_norm_tokens=4",
                "agents.listener.algorithm.ratio_level=sequence",
                "agents.listener.algorithm.clip_eps=0.001"]
    results = {}
    for mode in ("sync", "async"):
        cfg = load_config(EXAMPLES / "referential_game.yaml",
                          [f"pipeline.mode={mode}", "runtime.deterministic=true",
                           "train.iterations=2", *variants])
        assert cfg.agents["speaker"].algorithm.loss_agg == "token_sum_norm"
        assert cfg.agents["listener"].algorithm.ratio_level == "sequence"
        results[mode] = train(cfg, tmp_path / mode)
        _assert_exactly_once(results[mode], cfg)
    for agent, path in results["sync"].checkpoints.items():
        assert _max_diff(path, results["async"].checkpoints[agent]) <= 1e-5
    assert all(r["agent/speaker/grad_norm"] > 0 for r in results["async"].records)
