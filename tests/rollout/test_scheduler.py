"""The shared replica scheduler, once per host engine: a fake engine, the real local engine
(`HFEngine` on a tiny model) and the simulator's `CostModelEngine`."""

from __future__ import annotations

from typing import Any

import pytest

from flexmarl.config.schema import ModelConfig
from flexmarl.policy.model import build_model
from flexmarl.rollout.engine import HFEngine
from flexmarl.rollout.scheduler import Loaded, ReplicaScheduler, Reply
from flexmarl.sim.cost import CostModel
from flexmarl.sim.models import ModelSpec
from flexmarl.sim.runtime.engine import CostModelEngine
from flexmarl.types import GenerationRequest, GenerationResult


class FakeEngine:
    """Continuous batching by counting: admission samples a sequence's first token, each
    step one more; a sequence ends at its `max_new_tokens`. Agents share the batch (as on a
    shared base)."""

    def __init__(self, max_seqs: int, max_tokens: int) -> None:
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self.seqs: list[list[Any]] = []  # [request, tokens]
        self.fail_next_step = False
        self.resets = 0

    @property
    def active(self) -> int:
        return len(self.seqs)

    def active_for(self, agent: str) -> int:
        return sum(1 for r, _ in self.seqs if r.agent == agent)

    def budget(self, request: GenerationRequest) -> int:
        return len(request.prompt) + request.max_new_tokens

    def fits(self, request: GenerationRequest, take=()) -> bool:
        if self.active + len(take) >= self.max_seqs:
            return False
        used = sum(self.budget(r) for r, _ in self.seqs) + sum(self.budget(r) for r in take)
        return used + self.budget(request) <= self.max_tokens or self.active + len(take) == 0

    def _retire(self) -> list[GenerationResult]:
        done = [s for s in self.seqs if s[1] >= s[0].max_new_tokens]
        self.seqs = [s for s in self.seqs if s[1] < s[0].max_new_tokens]
        return [GenerationResult(r.sample_id, [3] * n, [0.0] * n, r.version) for r, n in done]

    def admit(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        self.seqs += [[r, 1] for r in requests]
        return self._retire()

    def step(self) -> list[GenerationResult]:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("device lost")
        for s in self.seqs:
            s[1] += 1
        return self._retire()

    def load_weights(self, weights: Any, agent: str | None = None) -> None:
        pass

    def reset(self) -> None:
        self.seqs = []
        self.resets += 1


@pytest.fixture(scope="module")
def tiny_model():
    return build_model("a", ModelConfig(init_std=0.1), vocab_size=48, max_seq_len=96, run_seed=0)


COST = CostModel.named("H800")
SPEC = ModelSpec(name="tiny", params=1e6, layers=2, hidden=64, kv_heads=2, head_dim=32)


def make_engine(kind: str, max_seqs: int = 64, max_tokens: int = 1 << 20,
                model: Any = None) -> Any:
    if kind == "fake":
        return FakeEngine(max_seqs, max_tokens)
    if kind == "hf":
        return HFEngine(model, max_seqs, max_tokens)
    return CostModelEngine(COST, SPEC, 1, lambda r: r.max_new_tokens, max_seqs=max_seqs,
                           kv_cap=max_tokens)


ENGINES = ["fake", "hf", "sim"]


def req(i: int, agent: str = "a", version: int = 0, new: int = 4, prompt: int = 4
        ) -> GenerationRequest:
    return GenerationRequest(f"r{i}", agent, version, [1] + [5] * (prompt - 1), new, seed=1)


def turn(sched: ReplicaScheduler, watch: Any = None) -> list[Any]:
    """One scheduler turn as its host runs it (`watch` looks at it before a simulated
    engine's segment ends, here at once)."""
    events = sched.step()
    if watch is not None:
        watch()
    group = sched.last_group
    if group is not None and isinstance(sched.engines[group], CostModelEngine):
        results, _ = sched.engines[group].settle()
        events += sched.complete(group, results)
    return events


def drain(sched: ReplicaScheduler, watch: Any = None, limit: int = 500) -> list[Any]:
    events: list[Any] = []
    while sched.has_work():
        limit -= 1
        assert limit > 0, "the scheduler never ran out of work"
        events += turn(sched, watch)
    return events


def guard_loads(sched: ReplicaScheduler) -> list[tuple[str, int]]:
    """Record every load, and fail one that happens under the agent's running sequences."""
    seen: list[tuple[str, int]] = []
    for engine in sched.engines.values():
        inner = engine.load_weights

        def load(weights: Any, agent: str | None = None, engine=engine, inner=inner) -> None:
            assert agent is not None and engine.active_for(agent) == 0, "load under sequences"
            seen.append((agent, engine.active))
            inner(weights, agent)

        engine.load_weights = load
    return seen


def weights_of(kind: str, model: Any) -> Any:
    if kind == "hf":
        return {k: v.clone() for k, v in model.state_dict().items()}
    return None


def single(kind: str, model: Any, **kw: Any) -> ReplicaScheduler:
    seqs = kw.pop("max_batch_seqs", 64)
    tokens = kw.pop("max_tokens", 1 << 20)
    engine = make_engine(kind, seqs, tokens, model)
    return ReplicaScheduler({"a": ["a"]}, {"a": engine}, max_batch_seqs=seqs, **kw)


def replies(events: list[Any]) -> list[Reply]:
    return [e for e in events if isinstance(e, Reply)]


@pytest.mark.parametrize("kind", ENGINES)
def test_admission_stays_within_max_batch_seqs(kind, tiny_model):
    sched = single(kind, tiny_model, max_batch_seqs=2)
    engine = sched.engines["a"]
    for i in range(5):
        sched.submit(i, req(i, new=4), (i,))
    peak: list[int] = []
    events = turn(sched, lambda: peak.append(engine.active))
    assert sched.queued("a") == 3 and peak == [2]
    events += drain(sched, lambda: peak.append(engine.active))
    assert max(peak) <= 2
    got = replies(events)
    assert sorted(r.key for r in got) == [0, 1, 2, 3, 4] and all(r.ok for r in got)
    assert all(len(r.result.tokens) in (0, 4) for r in got)  # the sim's outputs are lengths


@pytest.mark.parametrize("kind", ENGINES)
def test_token_budget_skips_what_does_not_fit(kind, tiny_model):
    # budgets (prompt + max_new_tokens): 10, 20, 10 within 25: the 20 waits, the third joins
    sched = single(kind, tiny_model, max_tokens=25)
    sched.submit("A", req(0, new=6), (0,))
    sched.submit("B", req(1, new=16), (1,))
    sched.submit("C", req(2, new=6), (2,))
    first = turn(sched)
    admitted = {key for key, _ in sched.running["a"].values()} | {r.key for r in replies(first)}
    assert admitted == {"A", "C"} and sched.queued("a") == 1
    events = drain(sched)
    assert [r.key for r in replies(events)][-1] == "B"
    assert all(r.ok for r in replies(events))


@pytest.mark.parametrize("kind", ENGINES)
def test_requests_are_served_by_priority(kind, tiny_model):
    sched = single(kind, tiny_model, max_batch_seqs=1)
    for i, prio in enumerate([(3, 0), (1, 0), (2, 0), (1, 1)]):
        sched.submit(i, req(i, new=2), prio)
    order = [r.key for r in replies(drain(sched))]
    assert order == [1, 3, 2, 0]


@pytest.mark.parametrize("kind", ENGINES)
def test_version_gating_future_waits_stale_is_rejected(kind, tiny_model):
    sched = single(kind, tiny_model)
    sched.submit("new", req(0, version=1), ())
    assert not sched.has_work()  # a newer version waits for its weights without spinning
    loaded = sched.load("w1", "a", 1, weights_of(kind, tiny_model))
    assert [(e.key, e.ok, e.version) for e in loaded] == [("w1", True, 1)]
    sched.submit("old", req(1, version=0), ())
    events = replies(drain(sched))
    by_key = {r.key: r for r in events}
    assert by_key["new"].ok
    assert not by_key["old"].ok
    assert "wants version 0, replica holds 1" in by_key["old"].result


@pytest.mark.parametrize("kind", ENGINES)
def test_loads_wait_for_running_sequences(kind, tiny_model):
    sched = single(kind, tiny_model)
    seen = guard_loads(sched)
    sched.submit("r0", req(0, new=6), ())
    sched.step()  # admitted: running
    w = weights_of(kind, tiny_model)
    assert sched.load("w1", "a", 1, w) == []  # deferred
    assert sched.load("w2", "a", 2, w) == []  # supersedes it, answered with it
    sched.submit("r2", req(2, version=2, new=2), ())
    sched.submit("r1", req(1, version=1), ())  # superseded before it ran: never served
    assert sched.versions["a"] == 0
    if kind == "sim":  # the engine's segment ends
        results, _ = sched.engines["a"].settle()
        events = sched.complete("a", results) + drain(sched)
    else:
        events = drain(sched)
    keys = [(e.key, e.ok) for e in events]
    assert keys.index(("r0", True)) < keys.index(("w1", True)) < keys.index(("r2", True))
    assert ("w2", True) in keys and ("r1", False) in keys
    assert [e.version for e in events if isinstance(e, Loaded)] == [2, 2]
    assert seen == [("a", 0)]  # one load, with nothing running


@pytest.mark.parametrize("kind", ENGINES)
def test_engines_take_turns(kind):
    models = {g: build_model(g, ModelConfig(init_std=0.1), 48, 96, 0) if kind == "hf" else None
              for g in ("x", "y")}
    engines = {g: make_engine(kind, model=models[g]) for g in ("x", "y")}
    sched = ReplicaScheduler({"x": ["x"], "y": ["y"]}, engines)
    sched.submit("long", req(0, agent="x", new=30), ())
    sched.submit("short", req(1, agent="y", new=3), ())
    turns: list[str | None] = []
    events: list[Any] = []
    while sched.has_work():
        events += turn(sched)
        turns.append(sched.last_group)
    order = [r.key for r in replies(events)]
    if kind == "sim":  # one turn is a segment up to the first finish: the long one's
        assert turns == ["x", "y"] and order == ["long", "short"]
        return
    # one decode step per turn, in turn: the short one is done long before the long one
    assert turns[:4] == ["x", "y", "x", "y"] and order == ["short", "long"]


@pytest.mark.parametrize("kind", ENGINES)
def test_deterministic_mode_decodes_one_sequence_at_a_time(kind, tiny_model):
    sched = single(kind, tiny_model, max_batch_seqs=8, deterministic=True)
    engine = sched.engines["a"]
    for i in range(4):
        sched.submit(i, req(i, new=3), (i,))
    peak: list[int] = []
    events = drain(sched, lambda: peak.append(engine.active))
    assert max(peak) == 1
    assert [r.key for r in replies(events)] == [0, 1, 2, 3]


def test_hf_results_do_not_depend_on_the_scheduler_batching(tiny_model):
    """Deterministic mode and a full batch decode the same tokens (the engine's invariant,
    kept by the scheduler's admission)."""
    outs = []
    for det in (True, False):
        sched = single("hf", tiny_model, max_batch_seqs=8, deterministic=det)
        for i in range(4):
            sched.submit(i, req(i, new=5 + i), (i,))
        outs.append({r.key: r.result.tokens for r in replies(drain(sched))})
    assert outs[0] == outs[1]


def test_a_failing_engine_fails_its_batch_and_keeps_serving():
    sched = single("fake", None)
    engine = sched.engines["a"]
    sched.submit("a", req(0, new=5), ())
    sched.submit("b", req(1, new=5), ())
    turn(sched)
    engine.fail_next_step = True
    sched.submit("c", req(2, new=2), ())
    events = replies(turn(sched))
    assert {r.key for r in events} == {"a", "b", "c"} and not any(r.ok for r in events)
    assert "RuntimeError: device lost" in events[0].result and engine.resets == 1
    sched.submit("d", req(3, new=2), ())
    assert [(r.key, r.ok) for r in replies(drain(sched))] == [("d", True)]


def test_shared_base_defers_only_the_loaded_agents_weights():
    """Agents on one base share an engine: loading one agent's adapter waits for its own
    sequences only, the other's keep running."""
    engine = FakeEngine(64, 1 << 20)
    sched = ReplicaScheduler({"base:b": ["p", "q"]}, {"base:b": engine})
    sched.submit("p0", req(0, agent="p", new=8), ())
    sched.submit("q0", req(1, agent="q", new=3), ())
    turn(sched)
    assert [e.key for e in sched.load("wp", "p", 1, None)] == []  # p runs: deferred
    assert sched.load("wq", "q", 1, None) == []  # q runs too
    events = drain(sched)
    keys = [e.key for e in events]
    assert keys.index("q0") < keys.index("wq") < keys.index("p0") < keys.index("wp")
    assert sched.versions == {"p": 1, "q": 1}


def test_unknown_agents_are_refused_by_name():
    sched = single("fake", None)
    sched.submit("z", req(0, agent="zed"), ())
    (reply,) = replies(sched.step())
    assert not reply.ok and "'zed'" in reply.result and "hosts ['a']" in reply.result
    (loaded,) = sched.load("w", "zed", 1, None)
    assert not loaded.ok and "'zed'" in (loaded.error or "")
    with pytest.raises(ValueError, match="max_batch_seqs"):
        ReplicaScheduler({"a": ["a"]}, {"a": FakeEngine(1, 1)}, max_batch_seqs=0)
