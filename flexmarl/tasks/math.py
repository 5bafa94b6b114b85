"""Arithmetic word problems for two LLM agents, with data the project generates and rule-based
rewards: a solver answers, a checker judges the solver's answer.

- solver: "Compute a op b." (or a one-line word problem) -> free text up to `answer_tokens`
  tokens; reward 1 when the last integer it wrote is the right answer;
- checker: sees the problem and the solver's answer, says Yes or No (decoding restricted to
  those two tokens); reward 1 when its verdict matches the truth.

Prompts use the model's chat template; token ids come from its tokenizer (SmolLM2's by default).
Task success (for metrics) is the solver's accuracy.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from flexmarl.graph.meg import MEG, EpisodeContext, GraphError, NodePrompt
from flexmarl.graph.task import Task

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
WORDS = {
    "+": "{name} has {a} apples and buys {b} more. How many apples does {name} have now?",
    "-": "{name} has {a} apples and gives away {b}. How many apples does {name} have left?",
    "*": "{name} buys {a} bags with {b} apples each. How many apples does {name} have?",
}
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana"]


SYSTEM = "You are good at arithmetic."  # short: the default system prompt doubles the prompt


def _encode_chat(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def build_math_pair(max_operand: int = 20, ops: str = "+-", answer_tokens: int = 12,
                    words: bool = False) -> Task:
    for op in ops:
        if op not in OPS:
            raise GraphError(f"task.options.ops: unknown operation {op!r} (use +, - or *)")
    if not ops:
        raise GraphError("task.options.ops: at least one operation is required")
    if not isinstance(max_operand, int) or max_operand < 2:
        raise GraphError(f"task.options.max_operand: must be an integer >= 2, got {max_operand!r}")
    from flexmarl.policy.smollm import load_tokenizer

    tok = load_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    yes, no = tok.convert_tokens_to_ids("Yes"), tok.convert_tokens_to_ids("No")

    def question(data: dict[str, Any]) -> str:
        if words:
            return WORDS[data["op"]].format(name=data["name"], a=data["a"], b=data["b"])
        return f"Compute {data['a']} {data['op']} {data['b']}."

    def sample_inputs(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            op = ops[int(rng.integers(len(ops)))]
            a, b = int(rng.integers(1, max_operand + 1)), int(rng.integers(1, max_operand + 1))
            if op == "-" and b > a:
                a, b = b, a
            out.append({"a": a, "b": b, "op": op, "answer": OPS[op](a, b),
                        "name": NAMES[int(rng.integers(len(NAMES)))]})
        return out

    def answer_text(ctx: EpisodeContext) -> str:
        return tok.decode([t for t in ctx.output("solve") if t != end]).strip()

    def solver_correct(ctx: EpisodeContext) -> bool:
        numbers = re.findall(r"-?\d+", answer_text(ctx))
        return bool(numbers) and int(numbers[-1]) == ctx.data["answer"]

    def solve_prompt(ctx: EpisodeContext) -> NodePrompt:
        text = question(ctx.data) + " Reply with only the number."
        return NodePrompt(_encode_chat(tok, text), answer_tokens, None, [end])

    def check_prompt(ctx: EpisodeContext) -> NodePrompt:
        shown = answer_text(ctx).replace("\n", " ")[:80] or "(no answer)"
        text = (f"{question(ctx.data)}\nA student answered: {shown}.\n"
                f"Is the student's answer correct? Reply Yes or No.")
        return NodePrompt(_encode_chat(tok, text), 1, [yes, no])

    def check_reward(ctx: EpisodeContext) -> float:
        said_yes = ctx.output("check") == [yes]
        return 1.0 if said_yes == solver_correct(ctx) else 0.0

    graph = (
        MEG()
        .node("solve", agent="solver", prompt=solve_prompt,
              reward=lambda ctx: 1.0 if solver_correct(ctx) else 0.0)
        .node("check", agent="checker", inputs=["solve"], prompt=check_prompt,
              reward=check_reward)
        .set_success(solver_correct)
    )
    return Task(graph=graph, vocab_size=len(tok), sample_inputs=sample_inputs, max_seq_len=256,
                info={"layout": "math", "tokenizer": "smollm2"})
