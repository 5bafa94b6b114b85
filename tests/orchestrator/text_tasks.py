"""A small text-level task for tests: a writer answers in chat, a reader sees the writer's
decoded text. Rewards record what they saw (the driver process runs them) for assertions."""

from __future__ import annotations

from typing import Any

from flexmarl.graph.meg import MEG, EpisodeContext, TextPrompt
from flexmarl.graph.task import Task
from flexmarl.policy.tokenizer import BYTE_VOCAB

SEEN: list[dict[str, Any]] = []


def build_writer_reader() -> Task:
    def sample_inputs(rng, n):
        return [{"topic": str(int(rng.integers(10)))} for _ in range(n)]

    def write(ctx: EpisodeContext):
        return [{"role": "user", "content": f"topic {ctx.data['topic']}"}]

    def read(ctx: EpisodeContext) -> TextPrompt:
        return TextPrompt(f"the writer said: {ctx.text('write')}")

    def reward(ctx: EpisodeContext) -> float:
        SEEN.append({"write": (list(ctx.output("write")), ctx.text("write")),
                     "read": (list(ctx.output("read")), ctx.text("read"))})
        return float(len(ctx.text("write")) % 3) + float("a" in ctx.text("read"))

    graph = (MEG()
             .node("write", agent="writer", prompt=write, reward=reward)
             .node("read", agent="reader", inputs=["write"], prompt=read, reward=reward))
    return Task(graph=graph, vocab_size=BYTE_VOCAB, sample_inputs=sample_inputs, max_seq_len=96)
