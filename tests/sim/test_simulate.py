"""The `one-step-off` baseline: sync-disaggregated's static pools and stage-by-stage rollout,
with iteration k+1 generated on one-version-stale weights while step k trains."""

from pathlib import Path

from flexmarl.sim.simulate import BASELINES, SYSTEMS, simulate_system
from flexmarl.sim.workload import load_workload
from flexmarl.store.experience import parse_sample_id

WORKLOAD = Path(__file__).resolve().parents[2] / "examples" / "sim" / "solver_verifier.yaml"


def test_one_step_off_is_deterministic_overlaps_and_beats_sync_disaggregated():
    assert "one-step-off" in BASELINES and SYSTEMS["one-step-off"][:2] == ("one_step_off",
                                                                           "stage")
    wl = load_workload(WORKLOAD)
    a = simulate_system(wl, "one-step-off", iterations=3)
    b = simulate_system(wl, "one-step-off", iterations=3)
    assert a.makespan_s == b.makespan_s and a.utilisation == b.utilisation
    sync = simulate_system(wl, "sync-disaggregated", iterations=3)
    assert a.makespan_s <= sync.makespan_s
    assert 0 < a.efficiency <= 1.0 + 1e-9  # the lower bound accounts for the staleness
    # the audit: step k trained iteration k's rows, made by version max(0, k-1)
    for agent in a.runtime.trainable:
        trail = a.orchestrator.audit[agent]
        assert {(v, s) for _, v, s in trail} == {(0, 0), (0, 1), (1, 2)}
        assert all(sid.startswith(f"{s}-") for sid, _, s in trail)
        assert a.records[-1][f"agent/{agent}/policy_version"] == 3
    # iteration 1's rollout starts before the first optimizer step is done
    first_submit = min(t0 for sid, (t0, _) in a.runtime.requests.items()
                       if parse_sample_id(sid)[0].startswith("1-"))
    first_step_end = min(s.end for s in a.runtime.spans if s.pool == "train" and s.kind == "step")
    assert first_submit < first_step_end
