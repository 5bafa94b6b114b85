"""`POST /v1/episodes`: one episode of the run's graph (MEG) with the served agents.

The body names the episode's input (`input`: the task's input dict, e.g. the referential game's
`{"target": 7, "candidates": [6, 7, 9, 12]}`) or asks the task to draw one (`seed`). Nodes run
as in training: each as soon as its inputs exist (independent nodes in parallel), its prompt
built by the task from the episode so far, decoded with the node's token mask, stop tokens and
the agent's sampling temperature, each node wholly by one version of its agent. The answer has
every node's prompt, output, log-probs and version, and the episode's rewards and success.
The walk is training's own (`graph.executor.GraphExecutor`); only the call to an agent differs.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np

from flexmarl.errors import UserError
from flexmarl.graph.chat import PromptRenderer
from flexmarl.graph.contracts import ContractError
from flexmarl.graph.executor import GraphExecutor, NodeCall, TaskCodeError
from flexmarl.graph.meg import EpisodeContext
from flexmarl.serving.protocol import ApiError, Sampling, bad


def _checked_body(service: Any, body: dict) -> tuple[dict, int | None, float | None]:
    """(the episode's input, its seed, the temperature override) from the request body."""
    run = service.run
    task = run.task
    if task is None:
        raise ApiError(400, f"the run's task did not load, so its graph cannot run: "
                            f"{run.task_error}", code="no_task")
    missing = sorted({n.agent for n in task.graph.nodes.values()} - set(service.workers))
    if missing:
        raise ApiError(400, f"the graph needs agents that are not served here: "
                            f"{', '.join(missing)}", code="agents_not_served")
    data = body.get("input")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("seed", "must be an integer")
    if data is None:
        rng = np.random.default_rng(seed if seed is not None else uuid.uuid4().int % (1 << 63))
        data = task.sample_inputs(rng, 1)[0]
    if not isinstance(data, dict):
        raise bad("input", "must be an object: the task's episode input")
    temps = body.get("temperature")
    if temps is not None and (isinstance(temps, bool) or not isinstance(temps, (int, float))
                              or not 0 <= temps <= 2):
        raise bad("temperature", "must be a number in [0, 2] (overrides every agent's)")
    return data, seed, temps


async def run_episode(service: Any, body: dict, tenant: str | None = None
                      ) -> dict[str, Any]:
    run = service.run
    task = run.task
    data, seed, temps = _checked_body(service, body)
    graph = task.graph
    episode_id = uuid.uuid4().hex
    ctx = EpisodeContext(input_id=episode_id, trajectory_id=0, data=data)
    # agents hand their outputs to the next through the message bus, not through HTTP
    executor = GraphExecutor(graph, PromptRenderer(run.cfg.agents, task.vocab_size),
                             run.cfg.agents.keys(), handoff="bus")
    order = executor.order
    nodes: dict[str, dict[str, Any]] = {
        n: {"agent": graph.nodes[n].agent, "skipped": True} for n in order}

    team = service.team_canary
    arm = team.route() if team is not None else None

    async def call(node: NodeCall) -> list[int]:
        name, prompt = node.name, node.prompt
        spec = run.agents[node.agent]
        if any(not (0 <= t < spec.vocab) for t in prompt.tokens):
            raise ApiError(400, f"node {name!r}: the input yields token ids outside agent "
                                f"{node.agent!r}'s vocabulary of {spec.vocab}", "input")
        temperature = float(temps) if temps is not None else spec.cfg.sampling.temperature
        s = Sampling(agent=spec, prompt=list(prompt.tokens), max_tokens=prompt.max_new_tokens,
                     temperature=temperature, top_p=spec.cfg.sampling.top_p,
                     seed=(seed * 1000 + order.index(name)) if seed is not None else None,
                     stop=list(prompt.stop), stop_token_ids=list(prompt.stop_tokens),
                     allowed_token_ids=prompt.allowed_tokens,
                     token_ids_out=not (node.is_text and spec.tokenizer is not None),
                     tenant=tenant, pin=arm)
        if service.capture is not None:  # each node captured; feedback on the episode id
            s.response_id, s.endpoint, s.episode = f"ep-{episode_id}/{name}", "episodes", \
                f"ep-{episode_id}"
        outcome = None
        async for outcome in service.generate(s):  # noqa: B007
            pass
        if outcome is None:
            raise RuntimeError(f"node {name!r}: the agent's service returned no outcome")
        entry: dict[str, Any] = {
            "agent": node.agent, "skipped": False, "version": outcome.version.number,
            "id": s.response_id,
            "prompt": list(prompt.tokens), "output": outcome.tokens,
            "logprobs": outcome.logprobs}
        if spec.tokenizer is not None:
            entry["text"] = spec.tokenizer.decode(outcome.tokens, skip_special_tokens=True)
        nodes[name] = entry
        return list(outcome.tokens)

    try:
        ran = await executor.run(ctx, call)
    except TaskCodeError as exc:  # the task's code, or the input it was given
        raise ApiError(400, f"node {exc.node!r}: the task could not build its prompt from this "
                            f"input: {type(exc.error).__name__}: {exc.error}", "input",
                       code="bad_episode_input") from exc
    except ContractError as exc:
        raise ApiError(400, str(exc), "input", code="bad_episode_input") from exc
    except UserError as exc:  # the agent's tokenizer or chat template: the server's set-up
        raise ApiError(500, str(exc), kind="server_error") from exc
    result: dict[str, Any] = {"id": f"ep-{episode_id}", "object": "episode", "input": data,
                              "nodes": {n: nodes[n] for n in order}}
    scores = _scores(executor, ctx, [n for n in order if ran[n]])
    if team is not None and arm is not None:
        result["team_canary"] = arm
        if team.cfg.score == "feedback":
            team.arm_of[result["id"]] = arm
        else:
            value = scores.get("success", scores.get("reward"))
            if value is not None:
                team.observe(arm, float(value))
                await asyncio.to_thread(service.decide_team)
    return {**result, **scores}


def _scores(executor: GraphExecutor, ctx: EpisodeContext, ran: list[str]) -> dict[str, Any]:
    """The episode's rewards and success as the task scores them (its errors reported, not
    raised: the episode itself was served)."""
    graph = executor.graph
    out: dict[str, Any] = {}
    try:
        if graph.episode_reward is not None:
            out["reward"] = executor.team_reward(ctx)
        out["node_rewards"] = executor.node_rewards(
            ctx, [n for n in ran if graph.nodes[n].reward is not None])
        success = executor.success(ctx)
        if success is not None:
            out["success"] = success
    except (TaskCodeError, ContractError) as exc:
        out["reward_error"] = str(exc)
    return out
