"""Arithmetic for LLM agents, with data the project generates and rule-based rewards, written
with chat-level nodes: prompt builders return chat messages, rewards read `ctx.text(node)`;
FlexMARL applies each agent's tokenizer and chat template and trains on the exact ids sampled.

`build_math_pair` (solver -> checker):
- solver: "Compute a op b." (or a one-line word problem) -> a short answer; reward 1 when the
  last integer it wrote is the right answer;
- checker: sees the problem and the solver's answer, says Yes or No; reward 1 when its verdict
  matches the truth (an answer that is neither Yes nor No earns 0). With `judge="recompute"`
  the checker acts twice: it first computes the result itself (`recompute`, reward 1 for the
  right number), then compares the two numbers alone (`check`, the same verdict reward). A small
  model has next to no prior for judging a sum it is shown (SmolLM2-135M: AUC 0.50-0.59 of
  log P(Yes) - log P(No) against the truth, `benchmarks/judge_prior.py`) and a little more for
  comparing two numbers (0.57-0.66), so RL has something to sharpen; a direct judge of that
  size answers at chance and collapses onto one verdict.

`build_math_team` (solver -> verifier -> reviser), every agent rewarded for its own number:
- solver: answers the problem;
- verifier: sees the solver's answer and writes the correct result (copying a right answer,
  fixing a wrong one);
- reviser: sees both answers and gives the final one (task success is its accuracy).
Each reward is 1 for the right last integer; answers differ with the inputs, so an agent that
collapses onto one string loses reward instead of keeping it.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from flexmarl.graph.meg import MEG, EpisodeContext, GraphError, TextPrompt
from flexmarl.graph.task import Task
from flexmarl.policy.tokenizer import BYTE_VOCAB

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
WORDS = {
    "+": "{name} has {a} apples and buys {b} more. How many apples does {name} have now?",
    "-": "{name} has {a} apples and gives away {b}. How many apples does {name} have left?",
    "*": "{name} buys {a} bags with {b} apples each. How many apples does {name} have?",
}
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana"]

SYSTEM = "You are good at arithmetic."  # short: the default system prompt doubles the prompt
# Random-model agents on these tasks use the byte-level tokenizer (261 ids); SmolLM2 agents
# use their own vocabulary whatever this says.
TEXT_VOCAB = BYTE_VOCAB


def _check_options(max_operand: int, ops: str) -> None:
    if not ops:
        raise GraphError("task.options.ops: at least one operation is required")
    for op in ops:
        if op not in OPS:
            raise GraphError(f"task.options.ops: unknown operation {op!r} (use +, - or *)")
    if not isinstance(max_operand, int) or max_operand < 2:
        raise GraphError(f"task.options.max_operand: must be an integer >= 2, got {max_operand!r}")


def _sampler(max_operand: int, ops: str):
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

    return sample_inputs


def question(data: dict[str, Any], words: bool = False) -> str:
    if words:
        return WORDS[data["op"]].format(name=data["name"], a=data["a"], b=data["b"])
    return f"Compute {data['a']} {data['op']} {data['b']}."


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def last_int(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def shown(text: str) -> str:
    """An answer as the next agent reads it: one line, bounded."""
    return text.strip().replace("\n", " ")[:40] or "(no answer)"


def is_correct(ctx: EpisodeContext, node: str) -> bool:
    return last_int(ctx.text(node)) == ctx.data["answer"]


def verdict(text: str) -> str | None:
    word = text.strip().lower()
    return "yes" if word.startswith("yes") else "no" if word.startswith("no") else None


def build_math_pair(max_operand: int = 20, ops: str = "+-", answer_tokens: int = 12,
                    words: bool = False, judge: str = "direct") -> Task:
    _check_options(max_operand, ops)
    if judge not in ("direct", "recompute"):
        raise GraphError(f"task.options.judge: 'direct' or 'recompute', got {judge!r}")

    def solve_prompt(ctx: EpisodeContext) -> TextPrompt:
        return TextPrompt(chat(question(ctx.data, words) + " Reply with only the number."),
                          max_new_tokens=answer_tokens)

    def check_prompt(ctx: EpisodeContext) -> TextPrompt:
        text = (f"{question(ctx.data, words)}\nA student answered: {shown(ctx.text('solve'))}.\n"
                f"Is the student's answer correct? Reply Yes or No.")
        return TextPrompt(chat(text), max_new_tokens=2)

    def recompute_prompt(ctx: EpisodeContext) -> TextPrompt:
        return TextPrompt(chat(question(ctx.data, words) + " Reply with only the number."),
                          max_new_tokens=answer_tokens, stop=["\n"])

    def compare_prompt(ctx: EpisodeContext) -> TextPrompt:
        mine, theirs = last_int(ctx.text("recompute")), last_int(ctx.text("solve"))
        # worded as the model reads it best: "two answers the same?" starts at AUC 0.78-0.84
        # on SmolLM2-135M, "two numbers equal?" at 0.67 (benchmarks/judge_prior.py)
        text = (f"Answer 1: {'none' if mine is None else mine}\nAnswer 2: "
                f"{'none' if theirs is None else theirs}\nAre the two answers the same? "
                "Reply Yes or No.")
        return TextPrompt(chat(text), max_new_tokens=2)

    def check_reward(ctx: EpisodeContext) -> float:
        said = verdict(ctx.text("check"))
        truth = "yes" if is_correct(ctx, "solve") else "no"
        return 1.0 if said == truth else 0.0

    graph = MEG().node("solve", agent="solver", prompt=solve_prompt,
                       reward=lambda ctx: float(is_correct(ctx, "solve")))
    check_inputs = ["solve"]
    if judge == "recompute":
        graph.node("recompute", agent="checker", prompt=recompute_prompt,
                   reward=lambda ctx: float(is_correct(ctx, "recompute")))
        check_inputs.append("recompute")
    graph.node("check", agent="checker", inputs=check_inputs,
               prompt=compare_prompt if judge == "recompute" else check_prompt,
               reward=check_reward, label=lambda ctx: is_correct(ctx, "solve"))
    graph.set_success(lambda ctx: is_correct(ctx, "solve"))
    return Task(graph=graph, vocab_size=TEXT_VOCAB, sample_inputs=_sampler(max_operand, ops),
                max_seq_len=256, info={"layout": "math"})


def build_math_team(max_operand: int = 20, ops: str = "+-", answer_tokens: int = 12,
                    words: bool = False) -> Task:
    """solver -> verifier -> reviser; answers end at the first newline (a stop string)."""
    _check_options(max_operand, ops)
    if not isinstance(answer_tokens, int) or answer_tokens < 1:
        raise GraphError(f"task.options.answer_tokens: must be an integer >= 1, got "
                         f"{answer_tokens!r}")
    only = " Reply with only the number."

    def prompt(text: str) -> TextPrompt:
        return TextPrompt(chat(text + only), max_new_tokens=answer_tokens, stop=["\n"])

    def solve(ctx: EpisodeContext) -> TextPrompt:
        return prompt(question(ctx.data, words))

    def verify(ctx: EpisodeContext) -> TextPrompt:
        return prompt(f"{question(ctx.data, words)}\nA student answered: "
                      f"{shown(ctx.text('solve'))}.\nCheck the answer and give the correct "
                      "result.")

    def revise(ctx: EpisodeContext) -> TextPrompt:
        return prompt(f"{question(ctx.data, words)}\nFirst answer: {shown(ctx.text('solve'))}."
                      f"\nChecked answer: {shown(ctx.text('verify'))}.\nWhat is the final "
                      "result?")

    graph = (
        MEG()
        .node("solve", agent="solver", prompt=solve,
              reward=lambda ctx: float(is_correct(ctx, "solve")))
        .node("verify", agent="verifier", inputs=["solve"], prompt=verify,
              reward=lambda ctx: float(is_correct(ctx, "verify")))
        .node("revise", agent="reviser", inputs=["solve", "verify"], prompt=revise,
              reward=lambda ctx: float(is_correct(ctx, "revise")))
        .set_success(lambda ctx: is_correct(ctx, "revise"))
    )
    return Task(graph=graph, vocab_size=TEXT_VOCAB, sample_inputs=_sampler(max_operand, ops),
                max_seq_len=256, info={"layout": "math_team"})
