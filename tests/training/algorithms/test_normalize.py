"""`algorithm.normalize: group | agent | batch` (GRPO): which rewards an advantage is
normalised against, checked on hand-computed cases, in the algorithm and in the orchestrator
that picks the reference rows."""

import math

import numpy as np
import pytest

from flexmarl.config.schema import GRPOConfig, config_from_dict
from flexmarl.graph.task import load_task
from flexmarl.orchestrator.joint import IterationState, JointOrchestrator
from flexmarl.store.experience import Row, make_sample_id
from flexmarl.telemetry.recorder import Telemetry
from flexmarl.training.algorithms.grpo import (
    group_advantages,
    label_balanced_advantages,
    normalized_advantages,
)

EPS = 1e-6


def test_group_normalisation_by_hand():
    # mean 0.5, std 0.5
    a = 0.5 / (0.5 + EPS)
    assert group_advantages([1, 0, 0, 1], GRPOConfig()) == pytest.approx([a, -a, -a, a])
    assert group_advantages([0, 0], GRPOConfig()) == [0.0, 0.0]  # no signal in the group


def test_agent_and_batch_references_by_hand():
    # agent: its rows [1, 0 | 0, 0] over two groups: mean 0.25, std sqrt(3)/4
    std = math.sqrt(3) / 4
    assert normalized_advantages([1, 0, 0, 0], [1, 0, 0, 0], GRPOConfig()) == pytest.approx(
        [0.75 / (std + EPS)] + [-0.25 / (std + EPS)] * 3)
    # batch: pooled with another agent's [2, 2]: mean 5/6, std sqrt(29/36)
    std = math.sqrt(29 / 36)
    assert normalized_advantages([1, 0], [1, 0, 0, 0, 2, 2], GRPOConfig()) == pytest.approx(
        [(1 - 5 / 6) / (std + EPS), -5 / 6 / (std + EPS)])
    # scale_by_std off: centred only
    assert normalized_advantages([1, 0], [1, 0, 0, 0], GRPOConfig(scale_by_std=False)) == \
        pytest.approx([0.75, -0.25])


def test_normalize_is_a_grpo_option_only():
    base = {"task": {"builder": "x:y"},
            "agents": {"a": {"algorithm": {"name": "ppo", "normalize": "agent"}}}}
    with pytest.raises(Exception, match="normalize: option does not apply to algorithm 'ppo' "
                                        r"\(it is an option of grpo\)"):
        config_from_dict(base)
    base["agents"]["a"]["algorithm"] = {"name": "grpo", "normalize": "team"}
    with pytest.raises(Exception, match="agents.a.algorithm.normalize: Input should be 'group'"):
        config_from_dict(base)


@pytest.mark.parametrize("speaker_mode", ["group", "agent", "batch", "balanced"])
def test_orchestrator_normalises_over_the_chosen_rows(tmp_path, speaker_mode):
    """Two inputs x two trajectories of the referential game (speaker, listener): rewards (and
    the speaker's true classes) set by hand, advantages read back from the store."""
    speaker_algo = ({"normalize": "agent", "balance_labels": True} if speaker_mode == "balanced"
                    else {"normalize": speaker_mode})
    cfg = config_from_dict({
        "task": {"builder": "flexmarl.tasks.referential:build_referential_game"},
        "agents": {"speaker": {"algorithm": {"name": "grpo", **speaker_algo}},
                   "listener": {"algorithm": {"name": "grpo", "normalize": "group"}}},
        "train": {"iterations": 1, "inputs_per_iteration": 2, "group_size": 2},
    })
    task = load_task(cfg.task.builder, cfg.task.options)
    orch = JointOrchestrator(cfg, task, rollout=None, train=None, telemetry=Telemetry(tmp_path))
    it = IterationState(index=0, episodes_total=4, n_inputs=2)
    orch.episodes.iterations[0] = it
    rewards = {("speak", 0, 0): 1.0, ("speak", 0, 1): 0.0, ("speak", 1, 0): 0.0,
               ("speak", 1, 1): 0.0, ("listen", 0, 0): 2.0, ("listen", 0, 1): 2.0,
               ("listen", 1, 0): 4.0, ("listen", 1, 1): 0.0}
    agent_of = {"speak": "speaker", "listen": "listener"}
    for i in range(2):
        for traj in range(2):
            ids = {}
            for node in ("speak", "listen"):
                sid = make_sample_id(f"0-{i}", orch.episodes.turns[node], traj)
                agent = agent_of[node]
                turn = orch.episodes.turns[node]
                orch.store.add(Row(sid, agent, node, f"0-{i}", turn, traj, 0, 0,
                                   orch.version_book.vector(0)))
                orch.store.set_generated(agent, sid, {"prompt": [1], "response": [3]},
                                         {"logprobs": np.zeros(1, np.float32)})
                orch.store.set_rewarded(agent, sid, rewards[(node, i, traj)],
                                        ("y" if i == 0 else "n") if node == "speak" else None)
                ids[node] = sid
            it.groups[f"0-{i}"].append(ids)
            orch.episodes._maybe_group_ready(it, f"0-{i}")
        assert it.wide_ready == (i == 1)  # only once every group of the iteration is in

    def adv(node, i, traj):
        sid = make_sample_id(f"0-{i}", orch.episodes.turns[node], traj)
        return orch.store.table(agent_of[node]).get(sid).data["advantage"]

    speaker = [adv("speak", i, t) for i in range(2) for t in range(2)]
    if speaker_mode == "group":  # [1, 0] and [0, 0]: the second group carries no signal
        expected = [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0, 0.0]
    elif speaker_mode == "agent":  # the speaker's four rows: mean 0.25, std sqrt(3)/4
        std = math.sqrt(3) / 4
        expected = [0.75 / (std + EPS)] + [-0.25 / (std + EPS)] * 3
    elif speaker_mode == "balanced":  # class y [1, 0], class n [0, 0]: weights 1, balanced
        std = math.sqrt(3) / 4  # mean (0.5 + 0) / 2: here the same as the agent's own mean
        expected = [0.75 / (std + EPS)] + [-0.25 / (std + EPS)] * 3
    else:  # every trainable agent's eight rows: mean 9/8
        pooled = np.array([1, 0, 0, 0, 2, 2, 4, 0], dtype=float)
        expected = [(r - pooled.mean()) / (pooled.std() + EPS) for r in (1, 0, 0, 0)]
    assert speaker == pytest.approx(expected)
    # the listener stays group-normalised whatever the speaker does: [2, 2] -> 0, [4, 0] -> +-1
    listener = [adv("listen", i, t) for i in range(2) for t in range(2)]
    assert listener == pytest.approx([0.0, 0.0, 2 / (2 + EPS), -2 / (2 + EPS)])


def _team(speaker: dict, listener: dict | None = None, **train) -> dict:
    return {"task": {"builder": "flexmarl.tasks.referential:build_referential_game"},
            "agents": {"speaker": {"algorithm": {"name": "grpo", **speaker}},
                       "listener": listener or {"algorithm": {"name": "grpo"}}},
            "train": {"iterations": 2, "inputs_per_iteration": 1, "group_size": 2, **train}}


def _group(orch, it, k: int, rewards: list[float]) -> list[float]:
    """One input of iteration k whose two trajectories get `rewards` for the speaker (the
    listener 0): the speaker's advantages as the orchestrator sets them."""
    input_id = f"{k}-0"
    for traj, reward in enumerate(rewards):
        ids = {}
        for node, agent in (("speak", "speaker"), ("listen", "listener")):
            turn = orch.episodes.turns[node]
            sid = make_sample_id(input_id, turn, traj)
            orch.store.add(Row(sid, agent, node, input_id, turn, traj, k, k,
                               orch.version_book.vector(k)))
            orch.store.set_generated(agent, sid, {"prompt": [1], "response": [3]},
                                     {"logprobs": np.zeros(1, np.float32)})
            orch.store.set_rewarded(agent, sid, reward if agent == "speaker" else 0.0)
            ids[node] = sid
        it.groups[input_id].append(ids)
        it.rewards["speaker"].append(reward)
        orch.episodes._maybe_group_ready(it, input_id)
    table = orch.store.table("speaker")
    return [table.get(make_sample_id(input_id, orch.episodes.turns["speak"], t)).data[
        "advantage"] for t in range(len(rewards))]


def test_agent_previous_takes_the_previous_iterations_statistics(tmp_path):
    cfg = config_from_dict(_team({"normalize": "agent_previous"}))
    task = load_task(cfg.task.builder, cfg.task.options)
    orch = JointOrchestrator(cfg, task, rollout=None, train=None, telemetry=Telemetry(tmp_path))
    first = IterationState(index=0, episodes_total=2, n_inputs=1)
    orch.episodes.iterations[0] = first
    a = 0.5 / (0.5 + EPS)
    assert _group(orch, first, 0, [1.0, 0.0]) == pytest.approx([a, -a])  # no past: its group
    first.rewards["speaker"].extend([0.0, 0.0])  # the iteration's other rows: [1, 0, 0, 0]
    second = IterationState(index=1, episodes_total=2, n_inputs=1)
    orch.episodes.iterations[1] = second
    std = math.sqrt(3) / 4  # iteration 0: mean 0.25
    # the group agrees, yet each row is measured against the agent's last iteration
    assert _group(orch, second, 1, [0.0, 0.0]) == pytest.approx([-0.25 / (std + EPS)] * 2)
    assert 0 in second.groups_done  # the slot is done without waiting for the iteration

    # resumed: iteration 1 no longer in memory; its statistics come from the records
    del orch.episodes.iterations[1]
    orch.episodes.resumed_stats[1] = {"speaker": (0.5, 0.5)}
    third = IterationState(index=2, episodes_total=2, n_inputs=1)
    orch.episodes.iterations[2] = third
    assert _group(orch, third, 2, [1.0, 1.0]) == pytest.approx([0.5 / (0.5 + EPS)] * 2)


def test_label_balanced_advantages_by_hand():
    # class n: rewards 1,1,1,0 (mean 0.75); class y: 1,0 (mean 0.5). Weights 6 / (2 * 4) and
    # 6 / (2 * 2); the balanced mean (0.75 + 0.5) / 2 = 0.625 is every row's baseline; the std
    # is the weighted one around it.
    rewards, labels = [1, 1, 1, 0, 1, 0], ["n", "n", "n", "n", "y", "y"]
    w = [0.75] * 4 + [1.5] * 2
    centered = [r - 0.625 for r in rewards]
    std = math.sqrt(sum(wi * c * c for wi, c in zip(w, centered, strict=True)) / 6) + EPS
    expect = [wi * c / std for wi, c in zip(w, centered, strict=True)]
    got = label_balanced_advantages(rewards, labels, GRPOConfig(normalize="agent",
                                                                balance_labels=True))
    assert got == pytest.approx(expect)
    # a judge answering "no" to everything (class n all right, class y all wrong) still gets a
    # signal: toward "no" on class n, away from it on class y, each class the same total
    # (weights 5/6 and 5/4 around the balanced mean 0.5, std 0.5)
    collapsed = label_balanced_advantages([1, 1, 1, 0, 0], ["n", "n", "n", "y", "y"],
                                          GRPOConfig(normalize="agent", balance_labels=True))
    assert collapsed == pytest.approx([5 / 6 * 0.5 / (0.5 + EPS)] * 3
                                      + [-5 / 4 * 0.5 / (0.5 + EPS)] * 2)
    assert sum(collapsed) == pytest.approx(0.0)
    # one class only: the agent-wide normalisation
    assert label_balanced_advantages([1, 0], ["a", "a"], GRPOConfig()) == \
        pytest.approx(normalized_advantages([1, 0], [1, 0], GRPOConfig()))


def test_balance_labels_needs_the_agent_wide_baseline():
    with pytest.raises(ValueError, match="balance_labels .* needs normalize: agent"):
        GRPOConfig(balance_labels=True)


def test_an_agent_at_two_nodes_is_normalised_per_node(tmp_path):
    """The math pair's recompute judge (the checker computes, then compares): its two nodes do
    different jobs with different reward levels, so each node's rows get their own baseline."""
    cfg = config_from_dict({
        "task": {"builder": "flexmarl.tasks.math:build_math_pair",
                 "options": {"judge": "recompute"}},
        "agents": {"solver": {"algorithm": {"name": "grpo"}},
                   "checker": {"algorithm": {"name": "grpo", "normalize": "agent"}}},
        "train": {"iterations": 1, "inputs_per_iteration": 2, "group_size": 2},
    })
    task = load_task(cfg.task.builder, cfg.task.options)
    orch = JointOrchestrator(cfg, task, rollout=None, train=None, telemetry=Telemetry(tmp_path))
    it = IterationState(index=0, episodes_total=4, n_inputs=2)
    orch.episodes.iterations[0] = it
    agent_of = {"solve": "solver", "recompute": "checker", "check": "checker"}
    rewards = {"recompute": [1.0, 0.0, 0.0, 0.0], "check": [1.0, 1.0, 0.0, 1.0],
               "solve": [0.0] * 4}
    for i in range(2):
        for traj in range(2):
            ids = {}
            for node, agent in agent_of.items():
                turn = orch.episodes.turns[node]
                sid = make_sample_id(f"0-{i}", turn, traj)
                orch.store.add(Row(sid, agent, node, f"0-{i}", turn, traj, 0, 0,
                                   orch.version_book.vector(0)))
                orch.store.set_generated(agent, sid, {"prompt": [1], "response": [3]},
                                         {"logprobs": np.zeros(1, np.float32)})
                orch.store.set_rewarded(agent, sid, rewards[node][2 * i + traj])
                ids[node] = sid
            it.groups[f"0-{i}"].append(ids)
            orch.episodes._maybe_group_ready(it, f"0-{i}")

    def advantages(node):
        return [orch.store.table("checker").get(make_sample_id(
            f"0-{i}", orch.episodes.turns[node], t)).data["advantage"]
            for i in range(2) for t in range(2)]

    for node in ("recompute", "check"):  # each node: mean and std of its own four rows
        r = np.array(rewards[node])
        assert advantages(node) == pytest.approx(list((r - r.mean()) / (r.std() + EPS))), node


def test_agent_previous_of_an_agent_at_two_nodes_is_per_node(tmp_path):
    cfg = config_from_dict({
        "task": {"builder": "flexmarl.tasks.math:build_math_pair",
                 "options": {"judge": "recompute"}},
        "agents": {"solver": {"algorithm": {"name": "grpo", "normalize": "agent_previous"}},
                   "checker": {"algorithm": {"name": "grpo", "normalize": "agent_previous"}}},
        "train": {"iterations": 2, "inputs_per_iteration": 2, "group_size": 2},
    })
    task = load_task(cfg.task.builder, cfg.task.options)
    orch = JointOrchestrator(cfg, task, rollout=None, train=None, telemetry=Telemetry(tmp_path))
    past = IterationState(index=0, episodes_total=4, n_inputs=2)
    past.node_rewards.update({"recompute": [1.0, 0.0, 0.0, 0.0], "check": [1.0, 1.0, 0.0, 1.0],
                              "solve": [0.0, 1.0, 1.0, 1.0]})
    past.rewards.update({"checker": past.node_rewards["recompute"] + past.node_rewards["check"],
                         "solver": past.node_rewards["solve"]})
    orch.episodes.iterations[0] = past
    assert orch.episodes.previous_stats(1, "checker", "check") == pytest.approx(
        (0.75, math.sqrt(3) / 4))
    assert orch.episodes.previous_stats(1, "checker", "recompute") == pytest.approx(
        (0.25, math.sqrt(3) / 4))
    assert orch.episodes.previous_stats(1, "solver", "solve") == pytest.approx(
        (0.75, math.sqrt(3) / 4))  # one node: the agent's rows, as before
    # after a resume: from the records' per-node figures
    orch.episodes.iterations.clear()
    orch.episodes.resumed_stats[0] = {"node/check": (0.5, 0.5), "checker": (0.4, 0.1)}
    assert orch.episodes.previous_stats(1, "checker", "check") == (0.5, 0.5)
