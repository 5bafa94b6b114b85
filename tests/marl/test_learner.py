"""The one `Learner` role: the MAPPO learner, the VDN/QMIX replay learner and the LLM trainer
all play it, and the one `TrainHost` hosts the network learners as it hosts LLM trainers (a
policy swapped out mid-iteration and back in trains exactly as one never swapped)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("mpe2")

from flexmarl.config.schema import load_config  # noqa: E402
from flexmarl.marl.learner import LearnerError, learner_host  # noqa: E402
from flexmarl.marl.policies import MarlSample  # noqa: E402
from flexmarl.training import state as st  # noqa: E402
from flexmarl.training.host import TrainHost  # noqa: E402
from flexmarl.training.learner import Learner  # noqa: E402
from tests.marl.test_replay_run import _parts  # noqa: E402
from tests.marl.test_replay_run import cfg as qmix_cfg  # noqa: E402
from tests.marl.test_run import cfg as mappo_cfg  # noqa: E402
from tests.marl.test_run import in_process  # noqa: E402

RELAY = Path(__file__).resolve().parents[2] / "examples" / "relay_chain.yaml"


def test_llm_trainer_and_both_network_learners_play_the_learner_role() -> None:
    _, _, learners = in_process(mappo_cfg())
    _, q, _ = _parts(qmix_cfg())
    host = TrainHost(load_config(RELAY, ["runtime.deterministic=true"]), 32, 16)
    host.bind("speaker", None)
    for learner in [*learners.values(), q, host.trainers["speaker"]]:
        assert isinstance(learner, Learner), type(learner).__name__


def test_train_host_swaps_network_learners_exactly() -> None:
    """Two MAPPO policies time-share one `TrainHost` slot: `speaker_0` leaves the slot with
    rows held, `listener_0` takes it, `speaker_0` comes back into the learner the host kept;
    its step (metrics, audit, published weights) equals an unswapped host's, bit for bit."""
    c = mappo_cfg()
    run, env, _ = in_process(c)
    run.sampler.put(0, [env.run(0)])
    rows = {name: [s for _, ss in run.sampler.take(name, 0).values() for s in ss]
            for name in run.layouts}
    swapped, plain = learner_host(c, run.layouts), learner_host(c, run.layouts)
    for host in (swapped, plain):
        host.bind("speaker_0", None)
        host.handle("accumulate", ("speaker_0", rows["speaker_0"]))
    kept = swapped.kept["speaker_0"]
    out_agent, out_state, _, _ = swapped.bind("listener_0", None)
    assert out_agent == "speaker_0"
    swapped.handle("accumulate", ("listener_0", rows["listener_0"]))
    swapped.handle("step", "listener_0")
    assert swapped.bind("speaker_0", out_state)[0] == "listener_0"
    assert swapped.kept["speaker_0"] is kept and swapped.builds == 2  # loaded, not rebuilt
    (ma, wa), label = swapped.handle("step", "speaker_0")
    (mb, wb), _ = plain.handle("step", "speaker_0")
    assert label == "step:speaker_0" and ma == mb
    a, b = st.from_wire(wa), st.from_wire(wb)
    assert a.meta == b.meta and a.meta["version"] == 1 and a.meta["trained_on"]
    assert all(torch.equal(v, b.tensors[k]) for k, v in a.tensors.items())
    with pytest.raises(LearnerError, match="no policy 'nobody'"):
        swapped.bind("nobody", None)


def test_replay_learner_restart_point_round_trips_through_the_host() -> None:
    """`get_state` / `set_state` (a restarted slot's restore) of the VDN/QMIX learner through
    `TrainHost`: the replay table and held transitions come back, the next step is exact."""
    c = qmix_cfg()
    lay, _, worker = _parts(c)
    hosts = [learner_host(c, lay), learner_host(c, lay)]
    policy = next(iter(lay))
    for host in hosts:
        host.bind(policy, None)
    for k in range(3):
        worker.load(policy, k, hosts[0].trainers[policy].weights())
        res = worker.run(k)
        for host in hosts[:1]:
            host.handle("accumulate", (policy, [MarlSample(f"{k}-w0_0_0", k, k, 0,
                                                           res.transitions)]))
            if k < 2:
                host.handle("step", policy)
    arrays, meta = hosts[0].get_state(policy)
    assert hosts[1].set_state(policy, arrays, meta) == 2
    (ma, wa), _ = hosts[0].handle("step", policy)
    (mb, wb), _ = hosts[1].handle("step", policy)
    assert ma == mb and ma["replay_size"] > 0
    a, b = st.from_wire(wa), st.from_wire(wb)
    assert all(torch.equal(v, b.tensors[k]) for k, v in a.tensors.items())
