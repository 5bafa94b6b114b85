"""Whole-run env steps/s of classic MARL before and after it moved onto the local runtime
(rollout worker processes, training slots), side by side, rounds alternating.

    python benchmarks/mpe_runtime.py [--before 9215ce1] [--steps 20000] [--rounds 2]
                                     [--scenario speaker_listener] [--variants ...]
                                     [--algo vdn --num-envs 32]

(VDN / QMIX: `--before 7c44db5`, their in-process replay loop, vs the runtime.)

`--before` is a git revision whose `flexmarl/` is exported to a temporary folder and run in a
subprocess (its in-process driver); every variant of this tree runs in a subprocess too, so
each run pays its own imports and, here, its worker processes' start. Prints one row per
variant: the whole run's env steps/s (wall clock from the call to the result, worker start
included), the steady-state figure (median of the iterations' env_steps_per_s), the median
iteration's seconds after its rollout ended (`train_s`: the steps, and what of their inputs
did not overlap the rollout) and the return of the last 10% of iterations. The machine is
shared: rounds alternate so that load changes hit every variant, and the figures are floors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import yaml
from mpe import algorithm_sets  # (this folder: run as python benchmarks/mpe_runtime.py)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {"speaker_listener": "examples/mpe_speaker_listener.yaml",
            "spread": "examples/mpe_spread.yaml"}

CHILD = """
import json, sys, time
try:  # a tree since the environment run became a RunConfig, or one before (MarlRunConfig)
    from flexmarl.config.schema import load_config as load_marl_config
    from flexmarl.config.schema import RunConfig as _has_env
    assert "env" in _has_env.model_fields
except AssertionError:
    from flexmarl.marl.config import load_marl_config
from flexmarl.marl.run import train_marl
try:  # a tree before VDN / QMIX ran on the runtime: their in-process replay loop
    from flexmarl.marl.offpolicy import train_vdn
except ImportError:
    train_vdn = None
def main():
    cfg = load_marl_config(sys.argv[1], json.loads(sys.argv[2]))
    out = sys.argv[3] if len(sys.argv) > 3 else None
    algo = getattr(cfg, "env_algorithm", None) or cfg.algorithm
    train = (train_vdn if train_vdn is not None and algo.name in ("vdn", "qmix")
             else train_marl)
    t0 = time.perf_counter()
    res = train(cfg, out)
    wall = time.perf_counter() - t0
    recs = res.records
    tail = recs[-max(1, len(recs) // 10):]
    rets = [r["return_mean"] for r in tail if "return_mean" in r]
    steady = sorted(r["env_steps_per_s"] for r in recs[1:] or recs)
    after = sorted(r.get("train_s", float("nan")) for r in recs[1:] or recs)
    print(json.dumps({"env_steps": res.env_steps, "wall_s": wall,
                      "steady": steady[len(steady) // 2], "train_s": after[len(after) // 2],
                      "return": sum(rets) / max(len(rets), 1)}))
if __name__ == "__main__":
    main()
"""


def export(rev: str, into: Path) -> Path:
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "flexmarl"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def run_one(tree: Path, config: Path, sets: list[str], workdir: Path,
            out_dir: Path | None = None) -> dict:
    script = workdir / "child.py"
    script.write_text(CHILD)
    extra = [str(out_dir)] if out_dir is not None else []
    out = subprocess.run([sys.executable, str(script), str(config), json.dumps(sets), *extra],
                         cwd=workdir, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="9215ce1")
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scenario", default="speaker_listener", choices=list(EXAMPLES))
    ap.add_argument("--algo", default=None, choices=["mappo", "ippo", "vdn", "qmix"],
                    help="algorithm.name (default: the example's); vdn/qmix with their "
                         "defaults")
    ap.add_argument("--num-envs", type=int, default=None, help="env.num_envs override")
    ap.add_argument("--variants", default="before,after,after-2rollout,after-2slots",
                    help="before | after | after-2rollout | after-2slots | after-nosup | "
                         "after-ckpt | ray | after-2rollout-sync | after-2rollout-async")
    args = ap.parse_args()
    config = ROOT / EXAMPLES[args.scenario]
    base = [f"train.env_steps={args.steps}"]
    if args.num_envs is not None:
        base.append(f"env.num_envs={args.num_envs}")
    # the --before tree reads its own revision's example, whose algorithm was run-wide then
    old_base = [*base, *([f"algorithm={{name: {args.algo}}}"] if args.algo else [])]
    if args.algo is not None:
        base += algorithm_sets(config, **{"": f"{{name: {args.algo}}}"})
    half = max(1, (args.num_envs or yaml.safe_load(config.read_text())["env"]["num_envs"])
               // 2)
    variants = {
        "before": (f"in-process {'replay loop' if args.algo in ('vdn', 'qmix') else 'driver'}"
                   " (before)", None, old_base),
        "after": ("runtime: 1 rollout worker, 1 training slot", ROOT, base),
        # the same env steps per iteration, split over two worker processes
        "after-2rollout": (f"runtime: 2 rollout workers x {half} envs, 1 slot", ROOT,
                           [*base, "runtime.rollout_workers=2", f"env.num_envs={half}"]),
        "after-2slots": ("runtime: 1 rollout worker, 2 training slots", ROOT,
                         [*base, "runtime.train_workers=2"]),
        # pipeline.mode async (docs/marl.md, "Pipeline modes"): each rollout worker's rows go
        # to the learners as it ends; the step still waits for the last worker
        "after-2rollout-async": (f"runtime: 2 rollout workers x {half} envs, 2 slots, async",
                                 ROOT, [*base, "runtime.rollout_workers=2",
                                        f"env.num_envs={half}", "runtime.train_workers=2",
                                        "pipeline.mode=async"]),
        "after-2rollout-sync": (f"runtime: 2 rollout workers x {half} envs, 2 slots, sync",
                                ROOT, [*base, "runtime.rollout_workers=2",
                                       f"env.num_envs={half}", "runtime.train_workers=2"]),
        # reliability (docs/reliability.md): without the supervisor (no environment state
        # captured, no restart points kept) vs with it (the default, `after`), and with a
        # checkpoint generation written every iteration
        "after-nosup": ("runtime, no supervisor (max_worker_restarts=0)", ROOT,
                        [*base, "runtime.max_worker_restarts=0"]),
        "after-ckpt": ("runtime, supervisor + a checkpoint every iteration", ROOT,
                       [*base, "train.checkpoint_every=1"]),
        # the same workers as Ray actors, on a cluster started for the run (its start is in
        # the whole-run figure, not in the steady state)
        "ray": ("ray runtime: 1 rollout actor, 1 slot actor (cluster started for the run)",
                ROOT, [*base, "runtime.kind=ray"]),
    }
    chosen = args.variants.split(",")
    results: dict[str, list[dict]] = {v: [] for v in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        before = export(args.before, Path(tmp) / "before") if "before" in chosen else ROOT
        before_config = Path(tmp) / "before.yaml"
        if "before" in chosen:
            before_config.write_bytes(subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{args.before}:{EXAMPLES[args.scenario]}"],
                check=True, capture_output=True).stdout)
        for r in range(args.rounds):
            for v in chosen:
                _, tree, sets = variants[v]
                out_dir = Path(tmp) / f"out-{v}-{r}" if v == "after-ckpt" else None
                res = run_one(tree or before, config if tree else before_config, sets,
                              Path(tmp), out_dir)
                results[v].append(res)
                print(f"round {r} {v}: {json.dumps(res)}", flush=True)
    print(f"\n{args.scenario}, {args.algo or 'the example'}'s algorithm, {args.steps} env "
          f"steps per run, {args.rounds} rounds "
          f"alternating, mean over rounds (before = {args.before})\n")
    print("| variant | whole run env steps/s | steady-state env steps/s (median iteration) "
          "| wall s | after the last rollout worker, s (median iteration) "
          "| return (last 10%) |")
    print("|---|---|---|---|---|---|")
    for v in chosen:
        rs = results[v]
        whole = statistics.mean(x["env_steps"] / x["wall_s"] for x in rs)
        print(f"| {variants[v][0]} | {whole:.0f} | "
              f"{statistics.mean(x['steady'] for x in rs):.0f} | "
              f"{statistics.mean(x['wall_s'] for x in rs):.1f} | "
              f"{statistics.mean(x.get('train_s', float('nan')) for x in rs):.3f} | "
              f"{statistics.mean(x['return'] for x in rs):.2f} |")


if __name__ == "__main__":
    main()
