"""Metric loggers behind `logging.backends`: one interface, the same metric names everywhere.

Every backend receives, per iteration, the same flat dict of scalar metrics (`scalars(record)`:
the record's numbers under their fixed names, such as `agent/speaker/reward_mean` or
`pool/train/busy_frac`), with the iteration as the step. JSONL (`OUT/metrics.jsonl`) is always
written, with the full record (plans, errors, fault events): `flexmarl doctor`, `flexmarl
report` and `--resume` read it. The others are optional:

- `tensorboard`: event files under `OUT/tb/` (needs `tensorboard`);
- `wandb`: Weights & Biases, offline by default (`OUT/wandb/offline-run-*`, upload later with
  `wandb sync`), online with `logging.wandb.mode: online`;
- `mlflow`: MLflow, a local file store under `OUT/mlruns` by default, or any tracking URI.

`pip install 'flexmarl[loggers]'` installs the three.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from flexmarl.errors import UserError

_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class LoggerError(UserError, RuntimeError):
    """A configured logging backend is not installed or cannot start."""


class MetricLogger(Protocol):
    """What every backend implements."""

    name: str

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, status: str = "completed") -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers under their fixed names (the step, `iteration`, excluded;
    plans, error lists and strings are JSONL-only)."""
    out = {}
    for key, value in record.items():
        if key == "iteration" or isinstance(value, (str, dict, list, tuple)) or value is None:
            continue
        try:
            v = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(v):
            out[key] = v
    return out


def check_installed(backends: Sequence[str]) -> None:
    """Before a run starts: every configured backend can be imported."""
    for name in backends:
        module = _MODULES.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise LoggerError(f"logging.backends: {name!r} is configured but the {module} "
                              f"package is not installed; pip install 'flexmarl[loggers]' "
                              f"(or remove {name!r} from logging.backends)")


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, out_dir: Path) -> None:
        # optional dependency: the optional `loggers` extra
        from torch.utils.tensorboard import SummaryWriter

        self.dir = out_dir / "tb"
        self.writer = SummaryWriter(str(self.dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, status: str = "completed") -> None:
        self.writer.close()


class WandbLogger:
    name = "wandb"

    def __init__(self, out_dir: Path, run_name: str, options: Any, config: dict) -> None:
        import wandb  # optional dependency: the optional `loggers` extra

        self.dir = out_dir / "wandb"
        self.run = wandb.init(
            project=options.project, entity=options.entity, name=run_name, dir=str(out_dir),
            mode=options.mode, tags=list(options.tags) or None, config=config,
            settings=wandb.Settings(silent=True, console="off"), reinit="create_new",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, status: str = "completed") -> None:
        self.run.finish(exit_code=0 if status == "completed" else 1)
        if self.run.settings.mode == "offline":  # wandb-core writes the file a moment later
            wait_wandb_written(Path(self.run.dir).parent)


class MlflowLogger:
    name = "mlflow"

    def __init__(self, out_dir: Path, run_name: str, options: Any, config_file: Path | None):
        # optional dependency: the optional `loggers` extra
        from mlflow.tracking import MlflowClient

        self.uri = options.tracking_uri or (out_dir / "mlruns").resolve().as_uri()
        _allow_file_store(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(options.experiment)
        exp_id = exp.experiment_id if exp is not None else \
            self.client.create_experiment(options.experiment)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        if config_file is not None and config_file.exists():
            self.client.log_artifact(self.run_id, str(config_file))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric  # optional dependency: the optional `loggers` extra

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def close(self, status: str = "completed") -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if status == "completed" else "FAILED")


def _allow_file_store(uri: str) -> None:
    """MLflow 3.18 refuses its file store unless opted in (it is in maintenance mode, still
    supported); a local folder of plain files is what a run folder wants."""
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


def make_loggers(cfg: Any, out_dir: Path) -> list[MetricLogger]:
    """The optional backends of `cfg.logging` (JSONL is the Telemetry's own)."""
    backends = list(cfg.logging.backends)
    check_installed(backends)
    loggers: list[MetricLogger] = []
    try:
        for name in backends:
            if name == "tensorboard":
                loggers.append(TensorBoardLogger(out_dir))
            elif name == "wandb":
                loggers.append(WandbLogger(out_dir, cfg.name, cfg.logging.wandb,
                                           cfg.model_dump(mode="json")))
            elif name == "mlflow":
                loggers.append(MlflowLogger(out_dir, cfg.name, cfg.logging.mlflow,
                                            out_dir / "config.yaml"))
    except UserError:
        raise
    except Exception as exc:
        for logger in loggers:
            logger.close("failed")
        raise LoggerError(f"logging.backends: {name} could not start: "
                          f"{type(exc).__name__}: {exc}") from exc
    return loggers


# --- reading back (tests, and checking an offline run before `wandb sync`) ---------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The iteration records of a metrics.jsonl (fault events skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "iteration" in rec and "event" not in rec:
                out.append(rec)
    return out


def read_tensorboard(tb_dir: Path) -> dict[str, dict[int, float]]:
    # optional dependency: the optional `loggers` extra
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _wandb_records(run_dir: Path) -> list[Any]:
    """The protobuf records of an offline W&B run's .wandb file: a LevelDB-style log in 32 KiB
    blocks after a 7-byte header."""
    # generated protobuf code: its stub does not declare the message classes
    pb: Any = importlib.import_module("wandb.proto.wandb_internal_pb2")

    files = list(Path(run_dir).glob("*.wandb"))
    if not files:
        return []
    data = files[0].read_bytes()
    block, pos, partial, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding up to the block's end
            pos += room
            continue
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            records.append(payload)
        elif kind == 2:
            partial = payload
        elif kind == 3:
            partial += payload
        elif kind == 4:
            records.append(partial + payload)
    out = []
    for raw in records:
        rec = pb.Record()
        try:
            rec.ParseFromString(raw)
        except Exception:  # noqa: BLE001 - a record being written right now
            break
        out.append(rec)
    return out


def wait_wandb_written(run_dir: Path, timeout_s: float = 30.0) -> bool:
    """Until the run's file holds its exit record (wandb-core writes it asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(run_dir)):
            return True
        time.sleep(0.1)
    return False


def read_wandb_offline(run_dir: Path) -> dict[str, dict[int, float]]:
    """The history of an offline W&B run (`OUT/wandb/offline-run-*`)."""
    wait_wandb_written(run_dir)
    out: dict[str, dict[int, float]] = {}
    for rec in _wandb_records(run_dir):
        if rec.WhichOneof("record_type") != "history":
            continue
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                 for i in rec.history.item}
        step = int(items.pop("_step"))
        for key, value in items.items():
            if not key.startswith("_"):
                out.setdefault(key, {})[step] = float(value)
    return out


def read_mlflow(uri: str, experiment: str = "flexmarl") -> dict[str, dict[int, float]]:
    from mlflow.tracking import MlflowClient  # optional dependency: the optional `loggers` extra

    _allow_file_store(uri)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LoggerError(f"{uri}: no MLflow experiment {experiment!r}")
    run = client.search_runs([exp.experiment_id])[0]
    return {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            for key in run.data.metrics}
