"""Task builders used by tests: a reward that raises, a cyclic graph."""

from flexmarl.graph.meg import MEG, NodePrompt
from flexmarl.tasks.referential import build_referential_game


def reward_raises_on_trajectory_zero(**options):
    task = build_referential_game(**options)
    inner = task.graph.episode_reward

    def reward(ctx):
        if ctx.trajectory_id == 0 and ctx.input_id.endswith("-0"):
            raise ValueError("judge crashed on purpose")
        return inner(ctx)

    task.graph.set_episode_reward(reward)
    return task


def cyclic(**options):
    task = build_referential_game(**options)
    g = MEG()
    g.node("speak", agent="speaker", inputs=["listen"], prompt=lambda c: NodePrompt([1], 1))
    g.node("listen", agent="listener", inputs=["speak"], prompt=lambda c: NodePrompt([1], 1))
    task.graph = g
    return task


def short_inputs_from_iteration_one(**options):
    """sample_inputs returns one input too few from its second call on."""
    task = build_referential_game(**options)
    inner = task.sample_inputs
    calls = []

    def sample_inputs(rng, n):
        calls.append(n)
        return inner(rng, n) if len(calls) == 1 else inner(rng, n)[:-1]

    task.sample_inputs = sample_inputs
    return task
