"""Text- and chat-level nodes: from a prompt builder's value to the token ids an agent samples
from, and from the sampled ids back to text.

A prompt builder may return a `NodePrompt` (token ids: custom tasks keep full control), a plain
string, a list of chat messages (`[{"role": ..., "content": ...}]`) or a `TextPrompt` (either of
those with a node-level budget and stop strings). Text is encoded with the agent's tokenizer,
messages go through its chat template (`apply_chat_template`, generation prompt added). The
response is never re-tokenised: the ids the engine sampled are what the trainer trains on,
and downstream nodes and rewards read the decoded text (`ctx.text(node)`) next to them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flexmarl.config.schema import AgentConfig
from flexmarl.errors import UserError
from flexmarl.graph.meg import NodePrompt, TextPrompt
from flexmarl.policy.tokenizer import agent_tokenizer


class PromptError(UserError, ValueError):
    """A prompt builder returned something that is neither tokens, text nor chat messages."""


def _stop_list(where: str, field: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise PromptError(f"{where}: {field} must be a string or a list of strings, got "
                          f"{type(value).__name__}")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise PromptError(f"{where}: {field}[{i}] is {s!r} ({type(s).__name__}); a stop "
                              "string must be a non-empty string")
    return list(value)


def _messages(where: str, value: list[Any]) -> list[dict[str, str]]:
    if not value:
        raise PromptError(f"{where} returned an empty list (chat messages expected)")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise PromptError(f"{where} returned a list whose item #{i} is {m!r}; chat messages "
                              "are dicts {'role': str, 'content': str}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def stop_cut(text: str, stop: list[str]) -> tuple[str, bool]:
    """`text` cut before the earliest stop string, and whether one occurred."""
    cut = -1
    for s in stop:
        at = text.find(s)
        if at >= 0 and (cut < 0 or at < cut):
            cut = at
    return (text[:cut], True) if cut >= 0 else (text, False)


class PromptRenderer:
    """Turns prompt builders' values into `NodePrompt`s with each agent's tokenizer (loaded on
    first use) and sampling defaults, and decodes text-level responses."""

    def __init__(self, agents: Mapping[str, AgentConfig], task_vocab: int) -> None:
        self.agents = agents
        self.task_vocab = task_vocab

    def tokenizer(self, agent: str) -> Any:
        return agent_tokenizer(agent, self.agents[agent].model, self.task_vocab)

    def render(self, node: str, agent: str, value: Any) -> tuple[NodePrompt, bool]:
        """(the prompt in token ids, whether the node is text-level)."""
        where = f"node {node!r} (agent {agent!r}): prompt builder"
        if isinstance(value, NodePrompt):
            value.stop = _stop_list(where, "NodePrompt.stop", value.stop)
            return value, False
        if isinstance(value, list) and value and all(
                isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise PromptError(f"{where} returned a list of token ids, not NodePrompt; return "
                              "NodePrompt(tokens, max_new_tokens) for a token-level node, or "
                              "text / chat messages")
        if isinstance(value, (str, list)):
            value = TextPrompt(value)
        if not isinstance(value, TextPrompt):
            raise PromptError(
                f"{where} returned {type(value).__name__}; expected a NodePrompt (token ids), a "
                "string, a list of chat messages [{'role': ..., 'content': ...}] or a TextPrompt")
        sampling = self.agents[agent].sampling
        budget = value.max_new_tokens if value.max_new_tokens is not None else sampling.max_tokens
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise PromptError(f"{where}: TextPrompt.max_new_tokens is {budget!r}; the token "
                              "budget must be an integer >= 1")
        stop = list(sampling.stop) + _stop_list(where, "TextPrompt.stop", value.stop)
        tok = self.tokenizer(agent)
        prompt = value.prompt
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError(f"{where} returned an empty string")
            ids = tok.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list):
            messages = _messages(where, prompt)
            if not getattr(tok, "chat_template", None):
                raise PromptError(f"{where} returned chat messages, but agent {agent!r}'s "
                                  "tokenizer has no chat template; return plain text instead")
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            raise PromptError(f"{where}: TextPrompt.prompt is {type(prompt).__name__}; expected "
                              "a string or a list of chat messages")
        stop_tokens = list(sampling.stop_token_ids)
        if tok.eos_token_id is not None and tok.eos_token_id not in stop_tokens:
            stop_tokens.append(int(tok.eos_token_id))
        return NodePrompt([int(i) for i in ids], budget, None, stop_tokens, stop), True

    def decode(self, agent: str, tokens: list[int], stop: list[str]) -> str:
        """A text-level response as downstream nodes see it: special tokens skipped, cut before
        the first stop string (the ids themselves stay whole for training)."""
        text = self.tokenizer(agent).decode(tokens, skip_special_tokens=True)
        return stop_cut(text, stop)[0]
