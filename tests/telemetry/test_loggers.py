"""Each logging backend, read back from what it wrote on disk: the same metric names and
values as metrics.jsonl."""

from __future__ import annotations

import pytest

from flexmarl.config.schema import ConfigError, config_from_dict
from flexmarl.telemetry import loggers as L
from flexmarl.telemetry.recorder import Telemetry

RECORDS = [
    {"iteration": k, "wall_s": 0.5 + k, "task/success_rate": 0.25 * k,
     "agent/speaker/reward_mean": -1.0 + k, "agent/speaker/train_tokens_per_s": 100.0 * k,
     "pool/train/busy_frac": 0.5, "rollout/replica/0/busy_frac": 0.75, "episodes/failed": k,
     "rollout/plan": {"replicas": [1]}, "errors": ["x"], "grad": float("nan")}
    for k in range(3)
]
EXPECTED = {key for key in RECORDS[0] if key not in ("iteration", "rollout/plan", "errors",
                                                     "grad")}


def _cfg(backends):
    return config_from_dict({
        "name": "logtest", "task": {"builder": "x:y"}, "agents": {"a": {}},
        "logging": {"backends": backends},
    })


def _write(tmp_path, backends):
    cfg = _cfg(backends)
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("name: logtest\n")
    telemetry = Telemetry(out, loggers=L.make_loggers(cfg, out))
    for rec in RECORDS:
        telemetry.log(rec)
    telemetry.close()
    return out


def _same_as_records(history):
    assert set(history) == EXPECTED, set(history) ^ EXPECTED
    for key in EXPECTED:
        assert history[key] == {r["iteration"]: pytest.approx(float(r[key])) for r in RECORDS}, key


def test_jsonl_reads_back(tmp_path):
    out = _write(tmp_path, ["jsonl"])
    back = L.read_jsonl(out / "metrics.jsonl")
    assert [r["agent/speaker/reward_mean"] for r in back] == [-1.0, 0.0, 1.0]
    assert back[0]["rollout/plan"] == {"replicas": [1]} and back[0]["grad"] is None


def test_tensorboard_reads_back(tmp_path):
    pytest.importorskip("tensorboard")
    out = _write(tmp_path, ["tensorboard"])
    _same_as_records(L.read_tensorboard(out / "tb"))


def test_wandb_offline_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network, whatever the host says
    out = _write(tmp_path, ["wandb"])
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    _same_as_records(L.read_wandb_offline(runs[0]))


def test_mlflow_file_store_reads_back(tmp_path):
    pytest.importorskip("mlflow")
    out = _write(tmp_path, ["mlflow"])
    _same_as_records(L.read_mlflow((out / "mlruns").resolve().as_uri()))


def test_backend_config_errors():
    with pytest.raises(ConfigError, match="logging.backends.0: Input should be 'jsonl'"):
        _cfg(["neptune"])
    with pytest.raises(ConfigError, match="a backend is listed twice"):
        _cfg(["wandb", "wandb"])


def test_missing_package_is_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(L.LoggerError, match=r"pip install 'flexmarl\[loggers\]'"):
        L.check_installed(["jsonl", "wandb"])


def test_log_every_thins_the_backends_not_metrics_jsonl(tmp_path):
    """`train.log_every: 2` over iterations 0..4: the backends get iterations 1, 3 and the
    last (4); metrics.jsonl, which doctor and report read, gets all five."""

    class Seen:
        def __init__(self):
            self.steps = []

        def log(self, step, values):
            self.steps.append(step)

        def close(self, status):
            pass

    seen = Seen()
    telemetry = Telemetry(tmp_path, loggers=[seen], log_every=2, last_iteration=4)
    for k in range(5):
        telemetry.log({"iteration": k, "task/success_rate": 0.1 * k})
    telemetry.close()
    assert seen.steps == [1, 3, 4]
    assert [r["iteration"] for r in L.read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]
