"""`flexmarl doctor RUN_DIR`: read a run's metrics and name likely problems, with the remedy.

Each finding cites the metric and the iterations that triggered it. The rules follow the
troubleshooting table of docs/troubleshooting.md and this field's common failures: failing
episodes, non-finite steps, exploding gradient norms (unnormalised observations or rewards),
an oscillating reward (learning rate too high), entropy collapse and the "lazy agent", swap
thrash (too few training slots for the agents), a growing experience store, throughput drops.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flexmarl.config.schema import ConfigError
from flexmarl.telemetry.samples import read_samples


@dataclass
class Finding:
    problem: str
    severity: str  # "error" or "warning"
    metric: str
    iterations: list[int]
    evidence: str
    remedy: str
    agent: str | None = None

    def text(self) -> str:
        its = _ranges(self.iterations)
        who = f" [{self.agent}]" if self.agent else ""
        return (f"{self.severity.upper()}: {self.problem}{who}\n"
                f"  evidence: {self.metric}, iterations {its}: {self.evidence}\n"
                f"  remedy:   {self.remedy}")


@dataclass
class Run:
    path: Path
    records: list[dict[str, Any]]
    events: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    # OUT/samples.jsonl: what the agents said (telemetry.samples)
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def agents(self) -> list[str]:
        if self.config.get("agents"):
            return list(self.config["agents"])
        names = {k.split("/")[1] for r in self.records for k in r if k.startswith("agent/")}
        return sorted(names)

    def trainable(self) -> list[str]:
        agents = self.config.get("agents") or {}
        return [a for a in self.agents if (agents.get(a) or {}).get("trainable", True)]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        its, values = [], []
        for r in self.records:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                its.append(int(r["iteration"]))
                values.append(float(v))
        return its, values

    def agent_cfg(self, agent: str, *path: str, default: Any = None) -> Any:
        node: Any = (self.config.get("agents") or {}).get(agent) or {}
        for p in path:
            if not isinstance(node, dict) or p not in node:
                return default
            node = node[p]
        return node


def load_run(run_dir: str | Path) -> Run:
    """A run folder's metrics.jsonl (records and fault events), config.yaml, summary.json."""
    path = Path(run_dir)
    if not path.exists():
        raise ConfigError(f"{path}: no such run folder")
    if not path.is_dir():
        raise ConfigError(f"{path}: not a folder (pass the run folder, e.g. runs/<name>)")
    metrics = path / "metrics.jsonl"
    if not metrics.exists():
        raise ConfigError(f"{path}: no metrics.jsonl, not a run folder (pass the --out folder "
                          "of `flexmarl train`)")
    records: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for n, line in enumerate(metrics.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise ConfigError(f"{metrics}: line {n} is not JSON (a truncated or foreign "
                              "file?)") from None
        if not isinstance(item, dict):
            continue
        (events if "event" in item else records).append(item)
    records = [r for r in records if "iteration" in r]
    records.sort(key=lambda r: r["iteration"])
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    try:
        config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        pass
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    try:
        samples = read_samples(path / "samples.jsonl")
    except ValueError:  # a truncated or foreign file: the report goes on without it
        samples = []
    return Run(path, records, events, config if isinstance(config, dict) else {}, summary,
               samples)


# --- rules ---------------------------------------------------------------------------------
def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _thirds(values: list[float]) -> tuple[list[float], list[float]]:
    n = max(1, len(values) // 3)
    return values[:n], values[-n:]


def check_failures(run: Run) -> list[Finding]:
    out = []
    if run.summary.get("status") == "failed":
        out.append(Finding(
            "the run failed", "error", "summary.json status", [],
            f"{run.summary.get('error_type')}: {run.summary.get('error')}",
            "fix the first error it names; a failure budget stop means episodes kept failing "
            "(see below)"))
    its, failed = run.series("episodes/failed")
    _, total = run.series("episodes/total")
    bad = [(i, f, t) for i, f, t in zip(its, failed, total, strict=False) if f > 0]
    if bad:
        worst = max(bad, key=lambda x: x[1] / max(x[2], 1))
        first = next((r["errors"][0] for r in run.records if r.get("errors")), None)
        sev = "error" if worst[1] / max(worst[2], 1) > 0.1 else "warning"
        out.append(Finding(
            "failing episodes", sev, "episodes/failed", [b[0] for b in bad],
            f"{int(sum(b[1] for b in bad))} episodes failed, worst iteration {worst[0]}: "
            f"{int(worst[1])} of {int(worst[2])}" + (f"; first error: {first}" if first else ""),
            "the error names the node and the function (prompt builder, reward, endpoint); fix "
            "it there. train.max_failed_fraction stops a run whose episodes keep failing"))
    its, lost = run.series("rollout/workers_failed")  # an environment run's
    bad_its = [i for i, n in zip(its, lost, strict=True) if n > 0]
    if bad_its:
        workers = int((run.config.get("runtime") or {}).get("rollout_workers", 1) or 1)
        first = next((r["errors"][0] for r in run.records
                      if r.get("iteration") in bad_its and r.get("errors")), None)
        out.append(Finding(
            "rollout workers lost", "error" if max(lost) >= workers else "warning",
            "rollout/workers_failed", bad_its,
            f"{int(sum(lost))} rollout worker losses of {workers} workers per iteration"
            + (f"; first error: {first}" if first else ""),
            "a worker is lost for good once runtime.max_worker_restarts is used up (or is 0): "
            "the error says why (killed: memory, take fewer env.num_envs per worker); those "
            "iterations trained on the other workers' rows, and train.max_failed_fraction "
            "stops a run that keeps losing them"))
    skipped = [e for e in run.events if e.get("event") == "step_skipped"]
    if skipped:
        out.append(Finding(
            "optimizer steps skipped (non-finite loss or gradient)", "error",
            "step_skipped events", sorted({int(e.get("iteration", -1)) for e in skipped}),
            f"{len(skipped)} skipped: {skipped[0].get('reason')}",
            "lower the learning rate (0.8x per try) and normalise observations and rewards; "
            "set agents.<a>.optim.max_grad_norm"))
    return out


def check_gradients(run: Run) -> list[Finding]:
    """Exploding gradient norms (before clipping): unnormalised observations or rewards."""
    out = []
    for agent in run.trainable():
        its, norms = run.series(f"agent/{agent}/grad_norm")
        if len(norms) < 3:
            continue
        clip = run.agent_cfg(agent, "optim", "max_grad_norm", default=1.0) or 1.0
        early, late = _thirds(norms)
        big = [i for i, v in zip(its, norms, strict=True) if v > 50 * clip]
        growing = _median(late) > 10 * max(_median(early), 1e-12) and _median(late) > 5 * clip
        if len(big) >= max(2, len(norms) // 3) or growing:
            out.append(Finding(
                "exploding gradient norms", "error", f"agent/{agent}/grad_norm",
                big or its[-len(late):],
                f"median {_median(norms):.3g} (first third {_median(early):.3g}, last third "
                f"{_median(late):.3g}) against optim.max_grad_norm {clip:g}: clipping hides it, "
                "every step is scaled down",
                "normalise observations and rewards: keep rewards O(1) (scale them in the "
                "reward function), algorithm.scale_by_std: true (GRPO) or whiten_advantages "
                "(PPO); then lower optim.lr if it persists", agent))
    return out


def check_oscillation(run: Run) -> list[Finding]:
    """A reward that swings up and down instead of climbing, or a policy that moves too far in
    each step (many clipped tokens): the learning rate is too high."""
    out = []
    for agent in run.trainable():
        its, rewards = run.series(f"agent/{agent}/reward_mean")
        _, clip_frac = run.series(f"agent/{agent}/clip_frac")
        _, kl = run.series(f"agent/{agent}/kl")
        # a network agent (hybrid graphs) learns at network.algorithm.lr
        lr_key = ("network.algorithm.lr" if run.agent_cfg(agent, "network") is not None
                  else "optim.lr")
        lr = run.agent_cfg(agent, *lr_key.split("."), default=None)
        reasons, cited = [], []
        if len(rewards) >= 6:
            d = [b - a for a, b in zip(rewards, rewards[1:], strict=False)]
            moves = [x for x in d if abs(x) > 1e-9]
            flips = sum(1 for a, b in zip(moves, moves[1:], strict=False) if a * b < 0)
            spread = statistics.pstdev(rewards)
            amp = _median([abs(x) for x in moves])
            trend = abs(rewards[-1] - rewards[0])
            if moves and flips / max(len(moves) - 1, 1) >= 0.6 and spread > 0 and \
                    amp > 0.5 * spread and trend < 2 * amp and amp > _noise_swing(run, agent):
                reasons.append(f"reward_mean changed direction {flips} times in "
                               f"{len(moves)} moves (typical swing {amp:.3g}, net change "
                               f"{trend:.3g})")
                cited = its
        e_its, entropy = run.series(f"agent/{agent}/entropy")
        fast = next((i for i in range(1, min(4, len(entropy)))
                     if entropy[0] > 0.1 and entropy[i] < 0.01 * entropy[0]), None)
        if fast is not None and not (len(rewards) > fast and rewards[fast] > rewards[0]):
            reasons.append(f"entropy fell from {entropy[0]:.3g} to {entropy[fast]:.3g} within "
                           f"{fast} steps while reward_mean did not rise: the first steps "
                           "threw the policy onto one answer")
            cited = cited or e_its[:fast + 1]
        high_clip = [i for i, c in zip(its, clip_frac, strict=False) if c > 0.2]
        if clip_frac and len(high_clip) >= max(2, len(clip_frac) // 3):
            reasons.append(f"clip_frac > 0.2 in {len(high_clip)} of {len(clip_frac)} iterations "
                           f"(median {_median(clip_frac):.2f}): each step moves the policy "
                           "beyond the clip range")
            cited = cited or high_clip
        if reasons:
            new = f" (from {lr:g} to {0.8 * lr:.3g})" if isinstance(lr, (int, float)) else ""
            metric = (f"agent/{agent}/reward_mean" if cited is its
                      else f"agent/{agent}/entropy" if fast is not None
                      else f"agent/{agent}/clip_frac")
            out.append(Finding(
                "learning rate too high: oscillating reward / policy moving too fast", "error",
                metric, cited, "; ".join(reasons) + (f"; kl median {_median(kl):.3g}"
                                                     if kl else ""),
                f"lower agents.{agent}.{lr_key} by 0.8x{new}, repeat until reward_mean "
                "climbs steadily" + ("" if lr_key != "optim.lr" else
                                     "; optim.schedule: cosine or warmup_steps also help"),
                agent))
    return out


def _noise_swing(run: Run, agent: str) -> float:
    """How far an agent's reward_mean moves from one iteration to the next by sampling alone:
    1.5x the median |difference| of two independent means (0.954 of one mean's standard
    error), the error taken over the iteration's inputs rather than its rows (a group's
    samples share their input, so they are not independent: the cautious count). A small
    batch's swings below this are noise, not a learning rate; 0 when the run lacks the
    figures."""
    _, std = run.series(f"agent/{agent}/reward_std")
    _, rows = run.series(f"agent/{agent}/rows_trained")
    if not std or not rows:
        return 0.0
    group = (run.config.get("train") or {}).get("group_size") or 1
    inputs = max(_median(rows) / group, 1.0)
    return 1.5 * 0.954 * _median(std) / inputs ** 0.5


def collapse_remedy(run: Run, agent: str) -> str:
    """The option that moves a collapsed agent again, from the run's own config: a KL to the
    frozen reference (`kl_coef`) pulls a policy drifting onto one answer back toward its initial
    spread whatever the rewards say (the team default, docs/training.md); a judge's classes
    weighed equally around one balanced baseline (`balance_labels`) take away the majority
    answer's pay and still move a judge that answers one thing; a GRPO agent
    normalised per group has zero advantage on every group whose samples agree (all of them,
    once it answers one thing), while an agent-wide baseline (`normalize: agent`) still pays
    the inputs where the one answer is right over those where it is wrong; clip-higher lets
    the rare other answers grow."""
    algo = ((run.config.get("agents") or {}).get(agent) or {}).get("algorithm") or {}
    if not isinstance(algo, dict):
        algo = {}
    general = (f"agents.{agent}.algorithm.entropy_coef (e.g. 0.01-0.3, with "
               "entropy_decay_steps), a lower optim.lr, or a higher sampling.temperature; "
               "check the reward has no shortcut")
    steps = []
    if not algo.get("kl_coef"):
        steps.append(f"agents.{agent}.algorithm.kl_coef: 0.1 (a KL to the frozen reference "
                     "pulls a policy drifting onto one answer back toward its initial spread, "
                     "whatever its partner does; not when the starting checkpoint itself "
                     "answers one thing)")
    if algo.get("name", "grpo") == "grpo" and not algo.get("balance_labels"):
        steps.append(f"a judge or classifier: label= on its node and agents.{agent}.algorithm."
                     "balance_labels: true with normalize: agent (every true class weighs the "
                     "same around one balanced baseline: the majority answer earns nothing over "
                     "chance, and an agent answering one thing still gets a signal on every "
                     "class)")
    if algo.get("name", "grpo") == "grpo" and algo.get("normalize", "group") == "group":
        group_size = (run.config.get("train") or {}).get("group_size")
        size = f" {group_size}" if group_size else ""
        steps.append(f"agents.{agent}.algorithm.normalize: agent_previous or agent (with "
                     f"group_size{size} every group of one agreed answer has advantage 0, so "
                     "nothing moves it back; an agent-wide baseline still rewards the inputs it "
                     "gets right; agent_previous keeps the async pipeline's overlap)")
    if algo.get("clip_eps_high") is None:
        steps.append(f"agents.{agent}.algorithm.clip_eps_high: 0.28 (clip-higher: rare "
                     "answers with a positive advantage may grow)")
    return "; ".join([*steps, general])


def check_entropy(run: Run) -> list[Finding]:
    """The lazy agent: one agent sticks to one answer (whatever the input) that pays it, its own
    reward up, while the team does not improve; entropy collapse: the policy stopped exploring
    and gives the same answer to most inputs. (A policy that is deterministic per input but
    answers different inputs differently has converged; that is not a problem.)"""
    out = []
    _, success = run.series("task/success_rate")
    for agent in run.trainable():
        its, ent = run.series(f"agent/{agent}/entropy")
        t_its, top = run.series(f"agent/{agent}/top_response_frac")
        if len(ent) < 4 or ent[0] <= 0:
            continue
        collapsed = [i for i, e in zip(its, ent, strict=True) if e < 0.1 * ent[0]]
        if not collapsed or ent[-1] >= 0.1 * ent[0]:
            continue
        stuck = [i for i, f in zip(t_its, top, strict=True) if f >= 0.75]
        if top and not (stuck and _median(_thirds(top)[1]) >= 0.75):
            continue  # deterministic per input, different answers: converged
        _, own = run.series(f"agent/{agent}/reward_mean")
        # its own reward rose far more than the team's success: paid for something else
        team_gain = _median(_thirds(success)[1]) - _median(_thirds(success)[0]) \
            if len(success) >= 4 else 0.0
        own_gain = _median(_thirds(own)[1]) - _median(_thirds(own)[0]) if len(own) >= 4 \
            else 0.0
        evidence = (f"entropy fell from {ent[0]:.3g} to {ent[-1]:.3g} (below 10% from "
                    f"iteration {collapsed[0]})")
        if top:
            evidence += (f"; top_response_frac {top[-1]:.2f} (one answer for most inputs from "
                         f"iteration {stuck[0]})")
        if own_gain > 0.1 and own_gain > 3 * max(team_gain, 0.03):
            out.append(Finding(
                "lazy agent: stuck on one answer that pays it, not the team",
                "error", f"agent/{agent}/entropy", stuck or collapsed,
                evidence + f"; its reward_mean rose by {own_gain:.3g} (median of the first to "
                f"the last third: {_median(_thirds(own)[0]):.3g} -> "
                f"{_median(_thirds(own)[1]):.3g}), task/success_rate only by {team_gain:.3g} "
                f"({_median(_thirds(success)[0]):.3g} -> {_median(_thirds(success)[1]):.3g})",
                f"reward design: pay {agent} for the team outcome (train.credit.team, "
                f"upstream_discount) rather than a shortcut it can take alone; a curriculum "
                f"(easier inputs first); agents.{agent}.algorithm.entropy_coef > 0", agent))
        else:
            out.append(Finding(
                "entropy collapse: the policy gives one answer to most inputs", "warning",
                f"agent/{agent}/entropy", stuck or collapsed, evidence,
                collapse_remedy(run, agent), agent))
    return out


def check_one_verdict(run: Run) -> list[Finding]:
    """A judge giving one verdict to every input, seen through its nodes' true classes
    (`MEG.node(label=...)`): over the last third of iterations it is right on one class nearly
    always and on another nearly never. Its responses may still differ as strings ("No.",
    "No,"), so top_response_frac and entropy can miss what the per-class rewards show."""
    out = []
    for agent in run.trainable():
        prefix = f"agent/{agent}/reward_mean/"
        classes = sorted({k[len(prefix):] for r in run.records for k in r
                          if k.startswith(prefix)})
        if len(classes) < 2:
            continue
        last = {c: _thirds(run.series(prefix + c)[1])[1] for c in classes}
        if any(len(v) < 2 for v in last.values()):
            continue
        means = {c: sum(v) / len(v) for c, v in last.items()}
        high = [c for c, m in means.items() if m >= 0.9]
        low = [c for c, m in means.items() if m <= 0.1]
        if not (high and low):
            continue
        its = run.series(prefix + low[0])[0]
        per_class = ", ".join(f"{c} {means[c]:.2f}" for c in classes)
        balanced = [v for v in run.series(f"agent/{agent}/balanced_reward_mean")[1] if v]
        remedy = collapse_remedy(run, agent)
        if balanced and max(balanced) <= 0.6:  # never better than chance on both classes
            remedy = (f"{agent} never judged better than chance (balanced reward at most "
                      f"{max(balanced):.2f}): its model may have no signal for this judgment "
                      "to sharpen; measure it before training (benchmarks/judge_prior.py) and "
                      "give the judge something it can check, e.g. its own answer first "
                      "(tasks.math judge: recompute); then: " + remedy)
        out.append(Finding(
            "one verdict for every input: right on one true class, wrong on the other",
            "warning", prefix + low[0], its[-len(last[low[0]]):],
            f"reward by the node's true class over the last third of iterations: {per_class}",
            remedy, agent))
    return out


def check_swaps(run: Run) -> list[Finding]:
    """Swap thrash: agents time-sharing too few training slots swap states in and out."""
    its, swaps = run.series("pool/train/swaps")
    if not swaps:
        return []
    _, wait = run.series("pool/train/slot_wait_s")
    _, swap_s = run.series("pool/train/swap_s")
    agents = run.trainable()
    train_s = [sum(r.get(f"agent/{a}/train_s", 0.0) or 0.0 for a in agents) for r in run.records
               if "pool/train/swaps" in r]
    per_agent = _median(swaps) / max(len(agents), 1)
    lost = sum(wait) + sum(swap_s)
    share = lost / max(sum(train_s), 1e-9)
    slots = (run.config.get("runtime") or {}).get("train_workers")
    if per_agent > 2 and share > 0.3:
        cited = [i for i, s in zip(its, swaps, strict=True) if s / max(len(agents), 1) > 2]
        return [Finding(
            "swap thrash: too few training slots for the agents", "error", "pool/train/swaps",
            cited,
            f"median {_median(swaps):.0f} swaps per iteration ({per_agent:.1f} per agent); "
            f"slot waits + swaps {lost:.2f} s = {share:.0%} of the trainers' {sum(train_s):.2f} s"
            + (f"; {len(agents)} trainable agents on runtime.train_workers={slots}"
               if slots else ""),
            f"raise runtime.train_workers (to {len(agents)}: one slot per agent), or "
            "pipeline.mode: sync (agents train one after another, one swap each), or a larger "
            "train.micro_batch_size (fewer, longer turns on a slot)")]
    return []


def check_store(run: Run) -> list[Finding]:
    its, held = run.series("store/rows_held")
    if len(held) < 5:
        return []
    rising = all(b >= a for a, b in zip(held, held[1:], strict=False))
    if rising and held[-1] > 3 * max(held[1], 1):
        return [Finding(
            "growing experience store: rows are not evicted", "warning", "store/rows_held",
            its, f"{held[1]:.0f} -> {held[-1]:.0f} rows held, rising every iteration",
            "rows of finished versions should be evicted (the orchestrator evicts after each "
            "step): look for a trainer that stopped consuming (episodes/failed, step_skipped) "
            "or an agent whose rows nobody trains on")]
    return []


def check_throughput(run: Run) -> list[Finding]:
    out = []
    keys = [("rollout", f"agent/{a}/tokens_per_s") for a in run.agents]
    keys += [("training", f"agent/{a}/train_tokens_per_s") for a in run.trainable()]
    for what, key in keys:
        its, values = run.series(key)
        its, values = its[1:], values[1:]  # iteration 0 warms up
        if len(values) < 6:
            continue
        early, late = _thirds(values)
        if _median(early) > 0 and _median(late) < 0.5 * _median(early):
            n = len(late)
            out.append(Finding(
                f"{what} throughput dropped", "warning", key, its[-n:],
                f"median {_median(early):.3g} tokens/s early, {_median(late):.3g} late",
                "compare pool busy fractions and queue waits of the two periods: longer "
                "outputs, a slower replica (rollout/imbalance), swaps (pool/train/swaps), or "
                "another process on the machine",
                key.split("/")[1]))
    return out


def check_gpu_sharing(run: Run) -> list[Finding]:
    """Rollout and training processes on one GPU without MPS: in an overlapping pipeline their
    kernels take turns by time slices instead of running at once."""
    placement = run.summary.get("placement")
    mode = (run.config.get("pipeline") or {}).get("mode", "async")
    if not isinstance(placement, dict) or "mps" not in placement or placement["mps"] \
            or mode == "sync":
        return []

    def gpus(pool: str) -> set[int]:
        return {g for w in placement.get(pool) or [] if w.get("device") == "cuda"
                for g in w.get("gpus") or []}

    shared = sorted(gpus("rollout") & gpus("train"))
    if not shared:
        return []
    its, busy = run.series("pool/train/busy_frac")
    _, rollout_busy = run.series("pool/rollout/busy_frac")
    return [Finding(
        "rollout and training share a GPU without MPS", "warning", "placement", its,
        f"GPU {', '.join(map(str, shared))} runs both pools' processes (pipeline.mode {mode}) "
        f"with no MPS daemon; median busy fractions: rollout {_median(rollout_busy):.2f}, "
        f"training {_median(busy):.2f}",
        "start the MPS daemon before the run (`nvidia-cuda-mps-control -d`; `echo quit | "
        "nvidia-cuda-mps-control` stops it) so the pools' kernels run at once (one H100, "
        "relay chain async: 0.505 -> 0.413 s/iteration), or give the pools separate GPUs "
        "(runtime.rollout_devices / runtime.train_devices)")]


RULES = [check_failures, check_gradients, check_oscillation, check_entropy, check_one_verdict,
         check_swaps, check_store, check_throughput, check_gpu_sharing]


def diagnose(run: Run) -> list[Finding]:
    findings: list[Finding] = []
    for rule in RULES:
        findings.extend(rule(run))
    order = {"error": 0, "warning": 1}
    return sorted(findings, key=lambda f: order.get(f.severity, 2))


def _ranges(its: list[int]) -> str:
    if not its:
        return "-"
    its = sorted(set(its))
    parts, start, prev = [], its[0], its[0]
    for i in its[1:] + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def run_doctor(run_dir: str, as_json: bool = False) -> int:
    run = load_run(run_dir)
    findings = diagnose(run)
    if as_json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
        return 0
    print(f"flexmarl doctor {run.path}: {len(run.records)} iterations, agents "
          f"{', '.join(run.agents) or '-'}")
    if not run.records:
        print("no iteration was recorded yet (metrics.jsonl has no iteration records)")
    for f in findings:
        print()
        print(f.text())
    if not findings and run.records:
        print("no problems found")
    return 0
