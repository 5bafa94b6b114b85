"""One recorded comparison's real runs predicted from several profiles: the error of each
row per profile and its median over them (issue 31 item 5: "within 5%, the median of 3").

`python benchmarks/resimulate_profiles.py COMPARE_DIR PROFILE.json [PROFILE.json ...]
[--load-model mean|series] [--json OUT.json]` reads COMPARE_DIR/compare.json (`flexmarl bench
compare --out`, or a recorded one in tests/data/sim/: the configs are its `settings`),
simulates every round of every system with each profile exactly as `bench compare
--resimulate` does (`simulate_rows`), and prints per system the measured s/iteration, each
profile's error, the median error, and the run's own CPUs measured against the mirror's
(median over the profiles)."""

import argparse
import json
import statistics
from pathlib import Path

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import prepare
from flexmarl.sim.calibration.compare import SystemRow, simulate_rows
from flexmarl.sim.calibration.fits import LocalProfile

ROOT = Path(__file__).resolve().parents[1]


def rows_of(saved: dict) -> tuple[list[SystemRow], dict]:
    rows, cfgs = [], {}
    for r in saved["rows"]:
        rows.append(SystemRow(r["system"], s_per_iteration=r["s_per_iteration"],
                              other_load=r["other_load"], other_series=r.get("other_series", []),
                              makespan_s=r.get("makespan_s", []), own_load=r.get("own_load", [])))
        cfgs[r["system"]] = load_config(ROOT / saved["config"], saved["settings"][r["system"]])
    return rows, cfgs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("compare", help="a compare.json or the folder holding it")
    parser.add_argument("profiles", nargs="+")
    parser.add_argument("--load-model", default="mean", choices=("mean", "series"))
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    path = Path(args.compare)
    saved = json.loads((path / "compare.json" if path.is_dir() else path).read_text())
    errors: dict[str, list[float]] = {}
    own: dict[str, list[float]] = {}
    measured: dict[str, tuple[float, float]] = {}
    for p in args.profiles:
        rows, cfgs = rows_of(saved)
        simulate_rows(rows, cfgs, prepare(next(iter(cfgs.values()))), LocalProfile.load(p),
                      args.load_model)
        for r in rows:
            errors.setdefault(r.system, []).append(r.error)
            own.setdefault(r.system, []).append(statistics.median(r.simulated_own_load))
            measured[r.system] = (r.measured_s, statistics.median(r.own_load)
                                  if r.own_load else float("nan"))
    names = [Path(p).stem[-12:] for p in args.profiles]
    print(f"{'system':<24}{'measured':>9}" + "".join(f"{n:>13}" for n in names)
          + f"{'median':>9}{'own CPUs':>9}{'sim':>6}")
    for system, errs in errors.items():
        s, o = measured[system]
        print(f"{system:<24}{s:>9.3f}" + "".join(f"{e:>+13.1%}" for e in errs)
              + f"{statistics.median(errs):>+9.1%}{o:>9.2f}{statistics.median(own[system]):>6.2f}")
    med = [abs(statistics.median(e)) for e in errors.values()]
    print(f"rows within 5%: {sum(m <= 0.05 for m in med)} of {len(med)}; median |error| "
          f"{statistics.median(med):.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"errors": errors, "own_sim": own,
                                               "measured": measured}, indent=1))
