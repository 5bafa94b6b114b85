"""The waits read from a trace's spans (`sim.calibration.waits`), on a hand-made trace."""

from flexmarl.sim.calibration.waits import figures, waits
from flexmarl.telemetry.recorder import Span


def test_waits_by_state_and_gap():
    spans = [
        Span("rollout", 0, 0.0, 1.0, "gen:a"),
        Span("rollout", 0, 1.5, 1.6, "load:a"),  # waited 0.5 s for a version
        Span("rollout", 0, 1.6, 2.0, "gen:a"),
        Span("train", 0, 0.5, 1.2, "acc:a:4"),
        Span("train", 0, 1.3, 1.4, "step:a"),  # 0.1 s between the commands
        Span("train", 1, 1.0, 1.1, "swap:b"),
    ]
    got = waits(spans, 0.0, 2.0, 2)
    # both busy 0.5-1.0; rollout only 0-0.5 and 1.5-2.0; train only 1.0-1.2, 1.3-1.4;
    # nobody 1.2-1.3 and 1.4-1.5
    assert abs(got["state:both"] - 0.25) < 1e-9
    assert abs(got["state:rollout"] - 0.5) < 1e-9
    assert abs(got["state:train"] - 0.15) < 1e-9
    assert abs(got["state:none"] - 0.1) < 1e-9
    assert abs(got["replica_wait:load"] - 0.25) < 1e-9 and "replica_wait:gen" not in got
    assert abs(got["slot_wait:acc"] - 0.25) < 1e-9  # slot 0 idle from 0 to 0.5
    assert abs(got["slot_wait:step"] - 0.05) < 1e-9
    assert abs(got["slot_wait:swap"] - 0.5) < 1e-9  # slot 1 idle from 0 to 1.0
    assert abs(got["busy:train:acc"] - 0.35) < 1e-9
    # the window starts at the first rollout_plan event, over the iterations after the first
    after = figures(spans, [{"name": "rollout_plan", "time": 1.0}], 2)
    assert abs(after["state:none"] - 0.2) < 1e-9 and "state:both" not in after
