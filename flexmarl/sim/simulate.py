"""`flexmarl simulate`: run the production orchestrator on a simulated cluster, FlexMARL and
baselines side by side, and report makespan, speedup, utilisation and efficiency.

Baselines are settings of the same simulator, each named for what it models:
- `marti`: MARTI as it runs today (github.com/TsinghuaC3I/MARTI): every agent's models are
  colocated on its own equal share of the cluster (`colocate_all_models`, engines asleep while
  it trains), synchronous; since August 2025 rollout is one async workflow per episode
  (`marti/models/vllm/multi_agent_engine_async.py`), so a node starts when its own inputs are
  done (rollout schedule `dependency`); every agent's training starts at once and is waited
  on together (`MultiAgentController.step` in `marti/controllers/multi_agent_controller.py`
  calls each agent's `async_fit_actor_model`, then one `ray.get`); weights are broadcast one
  agent after another; prompts dealt round robin;
- `marti-2025-05`: MARTI before its async workflows: as `marti`, but turn-by-turn rollout (a
  graph level starts once the previous one is done in every episode) and one agent trained at
  a time;
- `mas-rl-like`: MAS-RL as the FlexMARL paper describes it (colocated and synchronous): the
  whole cluster is time-shared by the agents in turn, turn by turn: one agent's engines hold
  every accelerator for its turn of rollout, then the next agent's; then each agent trains on
  the whole cluster, one after another; each switch offloads the holder and loads the next;
- `sync-disaggregated`: separate rollout and training pools, synchronous, static splits;
- `one-step-off`: single-agent async applied per agent (verl's / AReaL's one-step off-policy
  async): sync-disaggregated's pools, static splits and stage-by-stage rollout, but iteration
  k+1 is generated with weights one version stale, so its rollout overlaps step k
  (`pipeline.mode: one_step_off`);
- `flexmarl`: async micro-batch pipeline + hierarchical balancing + agent-centric allocation;
- ablations `flexmarl-sync`, `flexmarl-stage`, `flexmarl-static-balance`,
  `flexmarl-static-alloc` switch off one feature each.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexmarl.orchestrator.joint import JointOrchestrator
from flexmarl.sim.cost import CostModel
from flexmarl.sim.runtime.clock import run_virtual
from flexmarl.sim.runtime.runtime import SimFeatures, SimRuntime
from flexmarl.sim.task import workload_config, workload_task
from flexmarl.sim.workload import Workload, load_workload
from flexmarl.store.experience import parse_sample_id
from flexmarl.telemetry.recorder import Telemetry

# name -> (pipeline mode, rollout schedule, simulated system features)
SYSTEMS: dict[str, tuple[str, str, SimFeatures]] = {
    # MARTI today: concurrent training, per-episode workflows, broadcasts in turn (see above)
    "marti": ("sync", "dependency", SimFeatures(colocated=True, balance="static",
                                                allocation="static", serial_publish=True)),
    # MARTI until its async workflows (mid-2025): turn by turn, agents trained one at a time
    "marti-2025-05": ("sync", "stage", SimFeatures(colocated=True, balance="static",
                                                   allocation="static",
                                                   sequential_training=True)),
    # MAS-RL as the FlexMARL paper describes it: the whole cluster time-shared, turn by turn
    "mas-rl-like": ("sync", "stage", SimFeatures(colocated=True, time_shared=True,
                                                 balance="static", allocation="static",
                                                 sequential_training=True)),
    "sync-disaggregated": ("sync", "stage", SimFeatures(balance="static", allocation="static")),
    "one-step-off": ("one_step_off", "stage", SimFeatures(balance="static",
                                                          allocation="static")),
    "flexmarl": ("async", "dependency", SimFeatures()),
    "flexmarl-sync": ("sync", "dependency", SimFeatures()),
    "flexmarl-stage": ("async", "stage", SimFeatures()),
    "flexmarl-static-balance": ("async", "dependency", SimFeatures(balance="static")),
    "flexmarl-static-alloc": ("async", "dependency", SimFeatures(allocation="static")),
}
BASELINES = ["marti", "marti-2025-05", "mas-rl-like", "sync-disaggregated",
             "one-step-off"]
ABLATIONS = ["flexmarl-sync", "flexmarl-stage", "flexmarl-static-balance",
             "flexmarl-static-alloc"]


@dataclass
class SimResult:
    system: str
    iterations: int
    makespan_s: float
    per_iteration_s: float
    utilisation: float
    lower_bound_s: float
    efficiency: float
    real_s: float
    runtime: SimRuntime
    # this process's CPU seconds (on a shared machine, wall time counts the others' too)
    cpu_s: float
    records: list[dict[str, Any]]
    orchestrator: JointOrchestrator


def simulate_system(wl: Workload, system: str, iterations: int | None = None,
                    features: SimFeatures | None = None,
                    cost: CostModel | None = None) -> SimResult:
    """`features` replaces the system's simulated features (its pipeline mode and rollout
    schedule stay), e.g. with `fixed_replicas` for a sweep over fixed splits; `cost` replaces
    the workload's cost model (e.g. another training MFU, for a sensitivity sweep)."""
    if system not in SYSTEMS:
        raise ValueError(f"--baseline: unknown system {system!r} (known: {', '.join(SYSTEMS)})")
    mode, schedule, features_of_system = SYSTEMS[system]
    features = features or features_of_system
    cfg = workload_config(wl, mode=mode, schedule=schedule, iterations=iterations)
    task = workload_task(wl)
    started = time.perf_counter()
    cpu_started = time.process_time()

    async def main():
        loop = asyncio.get_running_loop()
        telemetry = Telemetry(None, clock=loop.time)
        rt = SimRuntime(wl, features, cost, mode=mode)
        await rt.start()
        try:
            orch = JointOrchestrator(cfg, task, rt.rollout, rt.train, telemetry)
            records = await orch.run()
        finally:
            await rt.stop()
        return rt, orch, records

    # A simulation allocates millions of short-lived objects on top of a large live heap:
    # fewer full collections, same results (the cycle collector still runs).
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    try:
        rt, orch, records = run_virtual(main())
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
    real = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    n = len(records)
    makespan = records[-1]["time_s"]
    busy = rt.busy_accel_seconds()
    utilisation = busy / (rt.total * makespan)
    lower = lower_bound(rt, orch, n)
    per_it = makespan / n
    return SimResult(system, n, makespan, per_it, utilisation, lower, lower / per_it, real, rt,
                     cpu, records, orch)


def lower_bound(rt: SimRuntime, orch: JointOrchestrator, iterations: int) -> float:
    """max(critical path of one iteration, total work / total capacity), per iteration.

    The critical path is that of the on-policy pipeline's steady state, so it bounds pipelined
    and synchronous systems alike: agent a's nodes of iteration k+1 need a's version k+1, which
    needs all of a's rows of iteration k rewarded, which happens when their episodes end. So
    each iteration lasts at least, for every agent a, the longest dependency chain of one
    episode from the start of one of a's nodes to the end of that episode (every node served
    alone on an idle engine), plus a's optimizer step (on the whole cluster) and weight
    publication. With staleness s (one_step_off: 1) a's nodes of iteration k+1+s need version
    k+1 only, so chain + step spread over 1+s iterations, and each iteration still lasts at
    least the chain and the step. The work is the busy accelerator-seconds of this very run.
    """
    node_of = {turn: name for name, turn in orch.episodes.turns.items()}
    episodes: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for sid, lat in rt.solo_latency.items():
        input_id, turn, traj = parse_sample_id(sid)
        episodes[(input_id, traj)][node_of[turn]] = lat
    by_iteration: dict[str, list[dict[str, float]]] = defaultdict(list)
    for (input_id, _), lats in episodes.items():
        by_iteration[input_id.split("-")[0]].append(lats)
    cycles = [_cycle(rt, orch, eps) for eps in by_iteration.values()]
    # the makespan is at least the sum of the iterations' cycles
    critical = sum(cycles) / max(1, len(cycles))
    work = rt.busy_accel_seconds() / rt.total / iterations
    return max(critical, work)


def _cycle(rt: SimRuntime, orch: JointOrchestrator, episodes: list[dict[str, float]]) -> float:
    """The shortest time one iteration can take, from its episodes' solo node latencies."""
    lag = orch.staleness
    agent_of = {name: orch.episodes.graph.nodes[name].agent for name in orch.episodes.order}
    consumers: dict[str, list[str]] = defaultdict(list)
    for name in orch.episodes.order:
        for i in orch.episodes.graph.nodes[name].inputs:
            consumers[i].append(name)
    # per agent, the longest path of one episode from the start of one of its nodes to the
    # episode's end: its rows are rewarded (so trainable) only when their episode is over
    chain: dict[str, float] = defaultdict(float)
    for lats in episodes:
        to_end: dict[str, float] = {}
        for name in reversed(orch.episodes.order):
            if name in lats:
                to_end[name] = lats[name] + max(
                    (to_end[c] for c in consumers[name] if c in to_end), default=0.0)
                chain[agent_of[name]] = max(chain[agent_of[name]], to_end[name])
    critical = 0.0
    for agent in rt.trainable:
        spec = rt.wl.agent(agent)
        step = (rt.cost.optimizer_step_time(spec.model, rt.total)
                + rt.cost.weight_transfer_time(spec.model, inter_node=True, links=spec.tp))
        critical = max(critical, chain[agent], step, (chain[agent] + step) / (1 + lag))
    return critical


def write_trace(result: SimResult, path: Path) -> Path:
    lanes = sorted({s.lane for s in result.runtime.spans})
    tid = {lane: i for i, lane in enumerate(lanes)}
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid[lane], "args": {"name": lane}}
        for lane in lanes
    ]
    for s in result.runtime.spans:
        events.append({"ph": "X", "name": f"{s.kind}:{s.agent}", "cat": s.pool, "pid": 1,
                       "tid": tid[s.lane], "ts": s.start * 1e6,
                       "dur": (s.end - s.start) * 1e6, "args": {"accelerators": s.accelerators}})
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def write_gantt(results: list[SimResult], path: Path, max_lanes: int = 60,
                xlabel: str = "simulated time (s)") -> Path:
    """One panel per system, one lane per worker, colour per agent; rollout solid, training
    hatched. Lanes beyond `max_lanes` (large clusters) are left out of the picture."""
    import matplotlib  # optional dependency: the optional `plots` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency: the optional `plots` extra
    from matplotlib.patches import Patch  # optional dependency: the optional `plots` extra

    agents = [a.name for a in results[0].runtime.wl.agents]
    cmap = plt.get_cmap("tab20" if len(agents) > 10 else "tab10")
    colour = {a: cmap(i % cmap.N) for i, a in enumerate(agents)}
    horizon = max(r.makespan_s for r in results)
    fig, axes = plt.subplots(len(results), 1, figsize=(14, 3.2 * len(results)), squeeze=False)
    for ax, res in zip(axes[:, 0], results, strict=True):
        spans = [s for s in res.runtime.spans if s.pool in ("rollout", "train")]
        lanes = sorted({s.lane for s in spans}, key=lambda x: (not x.startswith("rollout"), x))
        # at most an equal number of lanes per (pool, agent), so every agent shows up
        by_group: dict[str, list[str]] = defaultdict(list)
        for lane in lanes:
            by_group[lane.rsplit("/", 1)[0] if lane.startswith("rollout/") else lane].append(lane)
        per_group = max(1, max_lanes // max(1, len(by_group)))
        keep = {lane for group in by_group.values() for lane in group[:per_group]}
        shown = [lane for lane in lanes if lane in keep]
        y = {lane: i for i, lane in enumerate(shown)}
        # one broken_barh per (lane, agent, pool): a 48-node run has ~10^5 spans
        bars: dict[tuple[str, str, str], list[tuple[float, float]]] = defaultdict(list)
        for s in spans:
            if s.lane in y:
                bars[(s.lane, s.agent, s.pool)].append((s.start, s.end - s.start))
        for (lane, agent, pool), xs in bars.items():
            train = pool == "train"
            ax.broken_barh(xs, (y[lane] - 0.4, 0.8), facecolors=colour[agent],
                           hatch="//" if train else None,
                           edgecolors="black" if train else colour[agent], linewidth=0.2)
        ax.set_yticks(range(len(shown)))
        ax.set_yticklabels(shown, fontsize=5 if len(shown) > 30 else 7)
        ax.set_xlim(0, horizon)
        ax.invert_yaxis()
        extra = f" ({len(lanes) - len(shown)} more lanes not shown)" if len(lanes) > len(shown) \
            else ""
        ax.set_title(f"{res.system}: {res.per_iteration_s:.1f} s/iteration, utilisation "
                     f"{res.utilisation:.2f}{extra}", fontsize=10)
    axes[-1, 0].set_xlabel(xlabel)
    handles = [Patch(color=colour[a], label=a) for a in agents]
    handles += [Patch(facecolor="white", edgecolor="black", label="rollout (solid)"),
                Patch(facecolor="white", edgecolor="black", hatch="//", label="training")]
    fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def simulate(path: str | Path, systems: list[str] | None = None, iterations: int | None = None,
             out: str | Path | None = None, pictures: bool = True) -> list[SimResult]:
    wl = load_workload(path)
    systems = systems or ["flexmarl", *BASELINES]
    if "flexmarl" not in systems:
        systems = ["flexmarl", *systems]
    results = [simulate_system(wl, s, iterations) for s in systems]
    flex = results[0]
    print(f"workload {wl.name}: {wl.cluster.nodes} nodes x {wl.cluster.accelerators_per_node} "
          f"{wl.cluster.accelerator.name}, {len(wl.agents)} agents, "
          f"{wl.episodes_per_iteration} episodes/iteration, {flex.iterations} iterations")
    print(f"{'system':<24}{'s/iteration':>12}{'speedup':>9}{'util':>7}{'util x':>8}"
          f"{'lower bound':>12}{'efficiency':>11}{'real s':>8}{'cpu s':>7}")
    for r in results:
        print(f"{r.system:<24}{r.per_iteration_s:>12.1f}{r.per_iteration_s and flex.per_iteration_s and r.per_iteration_s / flex.per_iteration_s:>9.2f}"  # noqa: E501
              f"{r.utilisation:>7.2f}{flex.utilisation / r.utilisation:>8.2f}"
              f"{r.lower_bound_s:>12.1f}{r.efficiency:>11.2f}{r.real_s:>8.1f}{r.cpu_s:>7.1f}")
    print("(speedup = that system's s/iteration / FlexMARL's; util x = FlexMARL's utilisation / "
          "that system's)")
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        write_trace(flex, out / "trace.json")
        summary = [{"system": r.system, "per_iteration_s": r.per_iteration_s,
                    "makespan_s": r.makespan_s, "utilisation": r.utilisation,
                    "lower_bound_s": r.lower_bound_s, "efficiency": r.efficiency,
                    "real_s": r.real_s, "cpu_s": r.cpu_s, "plan": r.runtime.plans[-1]}
                   for r in results]
        (out / "report.json").write_text(json.dumps(summary, indent=2))
        print(f"trace: {out / 'trace.json'}")
        if pictures:
            print(f"gantt: {write_gantt(results, out / 'gantt.png')}")
    return results
