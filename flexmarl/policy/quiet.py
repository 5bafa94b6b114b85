"""Third-party output a run does not pass on, silenced where we call the library: the progress
bars transformers draws for every model it loads (one per worker process and per load, in every
run's output) and the deprecation warnings peft triggers inside transformers when it wraps a
model. Warnings about the user's own code or data are left alone.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

from transformers import modeling_gguf_pytorch_utils as gguf_utils
from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """No progress bars while transformers loads or converts a model. Its GGUF reader draws a
    plain tqdm bar that no setting turns off: that one bar is swapped for a disabled one."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    drawn = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = drawn
        if was:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_peft_wrap() -> Iterator[None]:
    """peft reads `is_gradient_checkpointing`, which transformers deprecates: the warning is
    about peft's call, not the user's; nothing else is filtered."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* is deprecated",
                                category=FutureWarning)
        yield
