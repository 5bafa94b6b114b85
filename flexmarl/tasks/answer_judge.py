"""The task API reference's example team (docs/api/index.md): an answerer adds two numbers,
a judge says whether the answer is right. Rule-based rewards per node."""

from __future__ import annotations

from typing import Any

from flexmarl.graph import MEG, EpisodeContext, NodePrompt, Task, TextPrompt


def build_answer_judge(max_operand: int = 9, vocab_size: int = 0) -> Task:
    """`vocab_size`: only for random-model agents (pretrained models give their own)."""

    def ask(ctx: EpisodeContext) -> list[dict[str, str]]:
        a, b = ctx.data["a"], ctx.data["b"]
        return [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}]

    def judge(ctx: EpisodeContext) -> TextPrompt:
        return TextPrompt(f"Is {ctx.data['a']} + {ctx.data['b']} = {ctx.text('ask')}? "
                          "Answer Yes or No.", max_new_tokens=2)

    def right(ctx: EpisodeContext) -> bool:
        return ctx.text("ask").strip() == str(ctx.data["a"] + ctx.data["b"])

    def verdict(ctx: EpisodeContext) -> float:
        return float(ctx.text("judge").strip().startswith("Yes" if right(ctx) else "No"))

    def inputs(rng: Any, n: int) -> list[dict[str, int]]:
        return [{"a": int(rng.integers(max_operand + 1)), "b": int(rng.integers(max_operand + 1))}
                for _ in range(n)]

    graph = (MEG()
             .node("ask", agent="answerer", prompt=ask, reward=lambda ctx: float(right(ctx)))
             .node("judge", agent="judge", inputs=["ask"], prompt=judge, reward=verdict,
                   label=right)
             .set_success(right))
    return Task(graph=graph, sample_inputs=inputs, vocab_size=vocab_size)


def build_token_answer_judge(num_objects: int = 8) -> Task:
    """The same team for tiny random-model agents (token level, no tokenizer): the answerer
    sees an object and names its symbol (object i's symbol is symbol i; chance 1/num_objects),
    the judge sees the object and the named symbol and says YES or NO. Its best answer moves
    as the answerer learns: "always YES" becomes nearly right once the answerer mostly is,
    the co-adaptation trap a team's defaults must get out of."""
    bos, sep = 1, 2
    objects = list(range(3, 3 + num_objects))
    symbols = list(range(3 + num_objects, 3 + 2 * num_objects))
    yes, no = 3 + 2 * num_objects, 4 + 2 * num_objects

    def right(ctx: EpisodeContext) -> bool:
        return ctx.output("ask")[0] == symbols[ctx.data["object"]]

    def judge(ctx: EpisodeContext) -> NodePrompt:
        return NodePrompt([bos, objects[ctx.data["object"]], sep, *ctx.output("ask"), sep], 1,
                          [yes, no])

    def verdict(ctx: EpisodeContext) -> float:
        return float(ctx.output("judge")[0] == (yes if right(ctx) else no))

    def inputs(rng: Any, n: int) -> list[dict[str, int]]:
        return [{"object": int(rng.integers(num_objects))} for _ in range(n)]

    graph = (MEG()
             .node("ask", agent="answerer",
                   prompt=lambda ctx: NodePrompt([bos, objects[ctx.data["object"]], sep], 1,
                                                 symbols),
                   reward=lambda ctx: float(right(ctx)))
             .node("judge", agent="judge", inputs=["ask"], prompt=judge, reward=verdict,
                   label=right)
             .set_success(right))
    return Task(graph=graph, sample_inputs=inputs, vocab_size=5 + 2 * num_objects)
