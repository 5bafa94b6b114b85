"""Durable capture of served interactions and their feedback (`flexmarl serve --capture DB`).

One SQLite file in WAL mode with `synchronous=FULL`: a row is committed (and so on disk)
before its response is acknowledged, so a SIGKILL of the server loses no interaction a client
was answered for; the response id is the primary key, so none is stored twice.

interactions: id (the response id), agent, version (served), source, policy_version,
              endpoint, prompt (JSON token ids), response (JSON token ids), logprobs (JSON),
              text, finish_reason, created
feedback:     response_id (primary key: one reward per response), reward, comment, created
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS interactions (
  id TEXT PRIMARY KEY, agent TEXT NOT NULL, version INTEGER NOT NULL, source TEXT,
  policy_version INTEGER, endpoint TEXT NOT NULL, prompt TEXT NOT NULL, response TEXT NOT NULL,
  logprobs TEXT NOT NULL, text TEXT, finish_reason TEXT, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS feedback (
  response_id TEXT PRIMARY KEY REFERENCES interactions(id), reward REAL NOT NULL,
  comment TEXT, created REAL NOT NULL);
"""


class FeedbackError(ValueError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Capture:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def record(self, rid: str, agent: str, version: dict[str, Any], endpoint: str,
               prompt: list[int], tokens: list[int], logprobs: list[float], text: str,
               finish_reason: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO interactions VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (rid, agent, version["version"], version.get("source"),
                 version.get("policy_version"), endpoint, json.dumps(prompt), json.dumps(tokens),
                 json.dumps(logprobs), text, finish_reason, time.time()))

    def feedback(self, rid: str, reward: float, comment: str | None = None) -> None:
        with self._lock:
            if self._db.execute("SELECT 1 FROM interactions WHERE id=?", (rid,)).fetchone() is None:
                raise FeedbackError(404, f"id: no captured response {rid!r}")
            try:
                self._db.execute("INSERT INTO feedback VALUES (?,?,?,?)",
                                 (rid, reward, comment, time.time()))
            except sqlite3.IntegrityError:
                raise FeedbackError(409, f"id: response {rid!r} already has feedback") from None

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM interactions").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
