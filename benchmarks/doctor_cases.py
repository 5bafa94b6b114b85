"""Record the deliberately broken runs `flexmarl doctor` is tested on, and a healthy one.

    python benchmarks/doctor_cases.py [OUT]   # default runs/doctor-cases

Each run is a real CLI training run; its metrics.jsonl, summary.json and config.yaml are copied
to tests/data/doctor/<case>/ (small files), where tests/cli/test_doctor.py reads them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GAME = str(ROOT / "examples" / "referential_game.yaml")
RELAY = str(ROOT / "examples" / "relay_chain.yaml")
COMMON = ["--set", "train.iterations=16", "--set", "train.inputs_per_iteration=16"]

CASES = {
    "healthy": (GAME, ["--set", "runtime.train_workers=2"]),
    "high_lr": (GAME, ["--set", "runtime.train_workers=2",
                       "--set", "agents.speaker.optim.lr=0.3",
                       "--set", "agents.listener.optim.lr=0.3"]),
    "large_observations": (GAME, ["--set", "runtime.train_workers=2",
                                  "--set",
                                  "task.builder=tests.telemetry.broken_tasks:large_rewards",
                                  "--set", "agents.speaker.algorithm.scale_by_std=false",
                                  "--set", "agents.listener.algorithm.scale_by_std=false"]),
    "lazy_agent": (GAME, ["--set", "runtime.train_workers=2",
                          "--set", "task.builder=tests.telemetry.broken_tasks:lazy_speaker",
                          "--set", "agents.speaker.algorithm.entropy_coef=0",
                          "--set", "task.options.bonus=4",
                          "--set", "agents.speaker.optim.lr=0.03"]),
    "one_slot": (RELAY, ["--set", "runtime.train_workers=1", "--set", "train.micro_batch_size=8"]),
}


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/doctor-cases")
    only = sys.argv[2:] or list(CASES)
    for name in only:
        config, extra = CASES[name]
        run = out / name
        proc = subprocess.run([sys.executable, "-m", "flexmarl", "train", config, *COMMON,
                               *extra, "--out", str(run)], cwd=ROOT, capture_output=True,
                              text=True)
        print(f"{name}: exit {proc.returncode}", proc.stderr.strip().splitlines()[-1:])
        data = ROOT / "tests" / "data" / "doctor" / name
        data.mkdir(parents=True, exist_ok=True)
        for f in ("metrics.jsonl", "summary.json", "config.yaml", "trace.json"):
            if f == "trace.json" and name != "healthy":  # the report test's Gantt needs one
                continue
            if (run / f).exists():
                shutil.copy(run / f, data / f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
