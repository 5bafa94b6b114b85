"""Request validation and OpenAI-shaped responses.

Every rejected request gets an OpenAI error body, `{"error": {"message", "type", "param",
"code"}}`, with a 4xx status and a message that names the field and what to send instead.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from flexmarl.serving.agents import AgentSpec


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


@dataclass
class Limits:
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 8192
    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = 16
    max_pending: int = 1024  # requests queued or running across agents; beyond: 429
    max_stop: int = 4


# Accepted for compatibility when they hold their neutral value; anything else is refused.
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "best_of": 1, "echo": False,
           "logit_bias": None, "suffix": None, "tools": None, "functions": None,
           "tool_choice": "none", "response_format": None, "parallel_tool_calls": None}


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            low <= value <= high):
        raise bad(name, f"must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _int(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
        raise bad(name, f"must be an integer in [{low}, {high}], got {value!r}")
    return value


def _ids(body: dict, name: str, vocab: int, allow_empty: bool = True) -> list[int] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or (not value and not allow_empty) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value):
        raise bad(name, f"must be a list of token ids in [0, {vocab})")
    return value


def check_unsupported(body: dict) -> None:
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if value is None or value == neutral or (isinstance(value, (dict, list)) and not value):
            continue
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        raise bad(name, f"is not supported by this server (got {value!r}); leave it unset")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise bad("n", "only n=1 is served; send n requests (each with its own seed)")


@dataclass
class Sampling:
    """What a request asks of the engine, validated."""

    agent: AgentSpec
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    token_ids_out: bool = False  # text as `token_id:N` (the prompt was ids / no tokenizer)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    response_id: str | None = None  # set: the interaction is captured under this id
    endpoint: str = ""
    episode: str | None = None  # the episode a captured node belongs to
    tenant: str | None = None  # who asked (with --tenants), recorded with the capture
    pin: str | None = None  # "shadow" / "canary": the version a team canary's episode uses


def common(body: dict, spec: AgentSpec, prompt: list[int], limits: Limits,
           max_tokens_field: str = "max_tokens") -> Sampling:
    check_unsupported(body)
    if len(prompt) > limits.max_prompt_tokens:
        raise ApiError(400, f"prompt is {len(prompt)} tokens, over this server's limit of "
                            f"{limits.max_prompt_tokens} (--max-prompt-tokens)", "prompt",
                       code="prompt_too_long")
    max_tokens = body.get("max_completion_tokens", body.get(max_tokens_field))
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, max(spec.max_len - len(prompt), 1))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad("max_tokens", f"must be a positive integer, got {max_tokens!r}")
    if max_tokens > limits.max_tokens:
        raise ApiError(400, f"max_tokens: {max_tokens} is over this server's limit of "
                            f"{limits.max_tokens} (--max-tokens)", "max_tokens",
                       code="max_tokens_too_large")
    if len(prompt) + max_tokens > spec.max_len:
        raise ApiError(400, f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens "
                            f"({max_tokens}) exceeds agent {spec.name!r}'s context of "
                            f"{spec.max_len} positions", "max_tokens",
                       code="context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad("top_p", "must be > 0")
    seed = _int(body, "seed", None, -(1 << 63), (1 << 63) - 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "must be a non-empty string or a list of them")
    if len(stop) > limits.max_stop:
        raise bad("stop", f"at most {limits.max_stop} stop sequences")
    if stop and spec.tokenizer is None:
        raise bad("stop", f"agent {spec.name!r} has no tokenizer, so it cannot match stop "
                          "strings; send stop_token_ids instead")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad("stream_options", "must be an object")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "must be true or false")
    return Sampling(
        agent=spec, prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        seed=seed, stop=stop, stop_token_ids=_ids(body, "stop_token_ids", spec.vocab) or [],
        allowed_token_ids=_ids(body, "allowed_token_ids", spec.vocab, allow_empty=False),
        stream=stream, include_usage=bool(stream_options.get("include_usage")),
    )


def no_tokenizer(spec: AgentSpec, what: str) -> ApiError:
    return ApiError(400, f"agent {spec.name!r} has no tokenizer (its model is token-level), so "
                         f"it cannot take {what}; send token ids to /v1/completions instead, "
                         f"e.g. {{\"model\": \"{spec.name}\", \"prompt\": [1, 2, 3]}}",
                    "prompt" if what == "text" else "messages", code="no_tokenizer")


def completion_prompt(body: dict, spec: AgentSpec) -> tuple[list[int], bool]:
    """(prompt token ids, whether the prompt came as ids) for /v1/completions."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if spec.tokenizer is None:
            raise no_tokenizer(spec, "text")
        ids = list(spec.tokenizer.encode(prompt, add_special_tokens=True))
        if not ids:
            raise bad("prompt", "encodes to no tokens")
        return ids, False
    if isinstance(prompt, list) and prompt and all(isinstance(p, (list, str)) for p in prompt):
        raise bad("prompt", "batches of prompts are not served; send one request per prompt")
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < spec.vocab
            for t in prompt):
        raise bad("prompt", f"must be a string or a non-empty list of token ids in "
                            f"[0, {spec.vocab})")
    return prompt, True


ROLES = {"system", "user", "assistant", "developer", "tool"}


def chat_prompt(body: dict, spec: AgentSpec) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    if spec.tokenizer is None:
        raise no_tokenizer(spec, "chat messages")
    if not getattr(spec.tokenizer, "chat_template", None):
        raise ApiError(400, f"agent {spec.name!r}'s tokenizer has no chat template; send text "
                            "to /v1/completions instead", "messages", code="no_chat_template")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}]", f"must be an object with a role in {sorted(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad(f"messages[{i}].content", "only text parts are served")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"],
                      "content": content})
    try:
        text = spec.tokenizer.apply_chat_template(clean, add_generation_prompt=True,
                                                  tokenize=False)
    except Exception as exc:  # noqa: BLE001 - template errors are the request's
        raise bad("messages", f"the chat template of agent {spec.name!r} rejected them: "
                              f"{exc}") from exc
    ids = list(spec.tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise bad("messages", "encode to no tokens")
    return ids


class TextStream:
    """Incremental detokenization with stop strings: `push(tokens)` returns the text that is
    safe to emit (never a partial stop string, never a broken UTF-8 sequence); `stopped` says a
    stop string was reached (the text is cut before it)."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tok = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # the whole text so far (cut at a stop string once stopped)
        self.sent = 0
        self.stopped = False

    def push(self, tokens: list[int]) -> str:
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        text = self.tok.decode(self.tokens, skip_special_tokens=True)
        cut = -1
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s)))
            if at >= 0 and (cut < 0 or at < cut):
                cut = at
        if cut >= 0:
            self.stopped = True
            self.text = text[:cut]
            return self.flush()
        self.text = text
        # hold back what may become a stop string, and bytes of a character not yet complete
        end = min(len(text) - self.hold, len(text.rstrip("\ufffd")))
        if end <= self.sent:
            return ""
        out = text[self.sent:end]
        self.sent = end
        return out

    def flush(self) -> str:
        """The rest of the text (at the end of the response): the pieces join to `text`."""
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


def token_text(tokens: list[int]) -> str:
    return " ".join(str(t) for t in tokens)
