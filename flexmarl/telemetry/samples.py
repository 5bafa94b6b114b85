"""What the agents actually say: the rows a run keeps in OUT/samples.jsonl (the orchestrator
writes a few per agent and iteration, `logging.samples_per_agent`), read back for
`flexmarl train --show-samples N` (live) and `flexmarl report`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class SampleTail:
    """Reads the lines appended to a samples.jsonl since the last call (the file may not exist
    yet: a run writes it at its first iteration)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Every sample of a run folder's samples.jsonl ([] when the run kept none)."""
    return SampleTail(path).new()


def clip_text(value: str | list[int], width: int, one_line: bool = False) -> str:
    """A prompt or answer as text (token ids space-separated), its end kept when too long."""
    text = value if isinstance(value, str) else " ".join(str(t) for t in value)
    if one_line:
        text = text.replace("\n", "\\n")
    return text if len(text) <= width else "..." + text[-(width - 3):]


def format_sample(sample: dict[str, Any], width: int = 100) -> str:
    """Two lines: who said it and how it scored, then the prompt's end and the whole answer
    (special tokens and padding left visible: that is where reward bugs hide)."""
    adv = sample.get("advantage")
    head = (f"[{sample['agent']}] it {sample['iteration']} {sample['node']} "
            f"input {sample['input_id']}: reward {sample.get('reward')}"
            + (f", advantage {adv:+.3f}" if isinstance(adv, (int, float)) else ""))
    answer = clip_text(sample["answer"], width, True)
    return (f"{head}\n  prompt: {clip_text(sample['prompt'], width, True)}\n"
            f"  answer ({sample['answer_tokens']} tokens): {answer}")
