"""Checks made before any worker starts: the output and resume folders (the memory the agents'
models need is checked by `policy.memory.check_memory`).

Each failure is a `UserError` naming the folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from flexmarl.config.schema import ConfigError


def check_out_dir(out: Path, flag: str = "--out") -> None:
    """The output folder must be a folder (or creatable) and writable."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {out}: exists and is not a folder")
    parent = out
    while not parent.exists():  # the nearest existing ancestor must let us create it
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {out}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {out}: {parent} is not writable")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".flexmarl-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{flag} {out}: cannot write there: {exc.strerror or exc}") from exc


def check_resume_dir(resume: Path) -> None:
    if not resume.exists():
        raise ConfigError(f"--resume {resume}: no such folder")
    if not resume.is_dir():
        raise ConfigError(f"--resume {resume}: not a folder (pass a run folder or its "
                          "checkpoints/ folder)")
