"""Each agent's tokenizer, for text- and chat-level nodes and for stop strings.

- `model.kind: path`: the tokenizer saved in the model folder (transformers `AutoTokenizer`);
- `model.kind: smollm2`: SmolLM2's, from the converted cache (`policy.smollm`);
- `model.kind: random`: a built-in byte-level tokenizer (256 byte tokens after 5 specials,
  no merges, a small chat template). A random model has no folder and learns from scratch, so
  a fixed byte vocabulary is all it needs; the task's `vocab_size` must be >= 261 for it.

Tokenizers are loaded once per process and agent configuration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flexmarl.config.schema import ModelConfig
from flexmarl.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BYTE_SPECIALS = ["<pad>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SMOLLM2_VOCAB = 49152
BYTE_VOCAB = 261  # the byte-level tokenizer: 5 specials + 256 bytes

_CACHE: dict[str, Any] = {}


class TokenizerError(UserError, ValueError):
    """An agent needs a tokenizer it does not have, or one that does not fit its model."""


def byte_tokenizer() -> Any:
    """The fallback of random models: byte-level BPE without merges (every byte one token)."""
    # start-up cost: transformers loads when a tokenizer is built
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=BYTE_SPECIALS[2:])
    fast.chat_template = BYTE_CHAT_TEMPLATE
    return fast


SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def base_model_name(agent: str, cfg: ModelConfig) -> str:
    """What a checkpoint names as its base: SmolLM2's hub id, a model folder's path, or for a
    random model the agent (or shared base) whose seed drew it."""
    if cfg.kind == "smollm2":
        return SMOLLM2_NAME
    if cfg.kind == "path":
        return str(cfg.path)
    return f"flexmarl-random:{cfg.base or agent}"


SMOLLM2_CONTEXT = 8192


def pretrained_sizes(cfg: ModelConfig) -> tuple[int, int] | None:
    """(vocabulary size, context length) of a pretrained model (`smollm2`, or a `path` folder
    with a config.json), read without loading weights; None for a random model."""
    if cfg.kind == "smollm2":
        return SMOLLM2_VOCAB, SMOLLM2_CONTEXT
    if cfg.kind == "path" and cfg.path:
        config_file = Path(cfg.path) / "config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
            if "vocab_size" in config:
                return (int(config["vocab_size"]),
                        int(config.get("max_position_embeddings", SMOLLM2_CONTEXT)))
    return None


def model_vocab(cfg: ModelConfig, task_vocab: int) -> int:
    """The vocabulary size of the agent's model, without loading its weights."""
    if cfg.kind == "smollm2":
        return SMOLLM2_VOCAB
    if cfg.kind == "path" and cfg.path:
        config_file = Path(cfg.path) / "config.json"
        if config_file.is_file():
            return int(json.loads(config_file.read_text()).get("vocab_size", task_vocab))
    return task_vocab


def agent_tokenizer(agent: str, cfg: ModelConfig, task_vocab: int) -> Any:
    """The agent's tokenizer (see the module docstring); errors name the agent and field."""
    key = f"{agent}|{cfg.model_dump_json()}|{task_vocab}"
    if key in _CACHE:
        return _CACHE[key]
    if cfg.kind == "smollm2":
        from flexmarl.policy.smollm import load_tokenizer  # start-up cost: transformers

        tok = load_tokenizer()
    elif cfg.kind == "path":
        folder = Path(cfg.path or "")
        if not any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise TokenizerError(
                f"agent {agent!r}: a text-level node needs a tokenizer, but model.path "
                f"{str(folder)!r} has none (expected one of {', '.join(TOKENIZER_FILES)})")
        # start-up cost: transformers loads when a tokenizer is built
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"agent {agent!r}: the tokenizer in model.path {str(folder)!r} "
                                 f"cannot be loaded: {exc}") from exc
    else:
        tok = byte_tokenizer()
    vocab = model_vocab(cfg, task_vocab)
    if len(tok) > vocab:
        where = ("the task's vocab_size" if cfg.kind == "random"
                 else f"agents.{agent}.model's vocab_size")
        raise TokenizerError(
            f"agent {agent!r}: its tokenizer has {len(tok)} tokens but the model's vocabulary "
            f"has {vocab} ({where}); a text-level node needs ids the model can take"
            + (" (random models use a byte-level tokenizer of 261 tokens)"
               if cfg.kind == "random" else ""))
    _CACHE[key] = tok
    return tok
