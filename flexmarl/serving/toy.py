"""A tiny run folder built offline, for tests and `benchmarks/serve.py`.

The referential game (speaker -> listener), where the speaker is the game's token-level random
Llama (no tokenizer) and the listener is a tiny random Llama saved next to a real byte-level BPE
tokenizer trained in-process on a few sentences, with a chat template: one run that exercises
token-id agents, text and chat agents, and the graph. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from flexmarl.policy.tokenizer import BYTE_CHAT_TEMPLATE, BYTE_SPECIALS

SENTENCES = [
    "The speaker sees a target object and sends a short message.",
    "The listener reads the message and names one of the candidates.",
    "Agents learn a shared code together from the team reward.",
    "Hello! How are you today? I am fine, thank you.",
    "Continuous batching keeps the batch full while long generations run.",
    "One two three four five six seven eight nine ten.",
]


def make_tokenizer(folder: Path, vocab_size: int = 320):

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=BYTE_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")
    fast.chat_template = BYTE_CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def save_llama(folder: Path, vocab_size: int, seed: int, hidden: int = 32, layers: int = 2,
               max_len: int = 256) -> None:

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=max_len, tie_word_embeddings=False,
                         initializer_range=0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(str(folder))


def make_toy_run(root: str | Path, listener_seed: int = 0) -> Path:
    """`root/run` (config.yaml, no checkpoints yet) and `root/listener-model` (the listener's
    model folder with its tokenizer); returns the run folder."""
    root = Path(root)
    model_dir = root / "listener-model"
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(model_dir)
    save_llama(model_dir, len(tok), listener_seed)
    run = root / "run"
    run.mkdir(exist_ok=True)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
             "init_std": 0.3}
    cfg = {
        "name": "toy-serve", "seed": 0,
        "task": {"builder": "flexmarl.tasks.referential:build_referential_game",
                 "options": {"num_objects": 8, "num_candidates": 4, "message_length": 1,
                             "num_symbols": 8}},
        "agents": {"speaker": {"model": small},
                   "listener": {"model": {"kind": "path", "path": str(model_dir)}}},
        "rollout": {"max_batch_seqs": 64},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run


def write_final(run: Path, agent: str, model_folder: Path, policy_version: int) -> Path:
    """Publish `model_folder`'s weights as the run's final checkpoint of `agent` (atomically:
    written aside, then renamed), as a trainer would."""

    dest = run / "checkpoints" / "final" / agent
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / "model.safetensors.tmp"
    shutil.copyfile(model_folder / "model.safetensors", tmp)
    shutil.copyfile(model_folder / "config.json", dest / "config.json")
    (dest / "flexmarl.json").write_text(json.dumps({"agent": agent,
                                                    "policy_version": policy_version}))
    os.replace(tmp, dest / "model.safetensors")
    return dest
