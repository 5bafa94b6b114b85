"""Durable capture of served interactions and their feedback (`flexmarl serve --capture DB`).

One SQLite file in WAL mode with `synchronous=FULL`: a row is committed (and so on disk)
before its response is acknowledged, so a SIGKILL of the server loses no interaction a client
was answered for; the response id is the primary key, so none is stored twice.

interactions: id (the response id; `ep-X/node` for a node of episode `ep-X`), agent, version
              (served), source, policy_version, endpoint, prompt (JSON token ids), response
              (JSON token ids), logprobs (JSON), text, finish_reason, created, and what the
              trainer needs to recompute the sampled distribution: temperature (as served),
              top_p, allowed (JSON token ids or null), episode (the episode id or null),
              tenant (who was answered, with --tenants; null without)
feedback:     response_id (primary key: one reward per response), reward, comment, created
consumed:     response_id (primary key), agent, step, outcome, created: a row the online
              learner claimed; written in the same transaction that picks the rows, before it
              trains on them, so no row is trained on twice, across restarts too
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS interactions (
  id TEXT PRIMARY KEY, agent TEXT NOT NULL, version INTEGER NOT NULL, source TEXT,
  policy_version INTEGER, endpoint TEXT NOT NULL, prompt TEXT NOT NULL, response TEXT NOT NULL,
  logprobs TEXT NOT NULL, text TEXT, finish_reason TEXT, created REAL NOT NULL,
  temperature REAL, top_p REAL, allowed TEXT, episode TEXT, tenant TEXT);
CREATE TABLE IF NOT EXISTS feedback (
  response_id TEXT PRIMARY KEY REFERENCES interactions(id), reward REAL NOT NULL,
  comment TEXT, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS consumed (
  response_id TEXT PRIMARY KEY REFERENCES interactions(id), agent TEXT NOT NULL,
  step INTEGER NOT NULL, outcome TEXT NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS interactions_episode ON interactions(episode);
CREATE INDEX IF NOT EXISTS interactions_agent ON interactions(agent, created);
CREATE INDEX IF NOT EXISTS interactions_tenant ON interactions(tenant);
"""
# columns added after the first release: a file written by an older server gets them
_ADDED = {"temperature": "REAL", "top_p": "REAL", "allowed": "TEXT", "episode": "TEXT",
          "tenant": "TEXT"}
COLUMNS = ("id, agent, version, source, policy_version, endpoint, prompt, response, logprobs, "
           "text, finish_reason, created, temperature, top_p, allowed, episode, tenant")


def _tenant_filter(tenants: list[str] | None) -> tuple[str, list[str]]:
    """SQL (and its parameters) keeping rows of `tenants` only; None: every row."""
    if tenants is None:
        return "", []
    return f" AND i.tenant IN ({','.join('?' * len(tenants))})", list(tenants)


class FeedbackError(ValueError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class CapturedRow:
    """A captured response with its feedback, as the online learner trains on it."""

    id: str
    agent: str
    version: int
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    temperature: float
    allowed: list[int] | None
    reward: float


class Capture:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        have = {r[1] for r in self._db.execute("PRAGMA table_info(interactions)")}
        if have:
            for col, kind in _ADDED.items():
                if col not in have:
                    self._db.execute(f"ALTER TABLE interactions ADD COLUMN {col} {kind}")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction (BEGIN IMMEDIATE: the write lock first); committed at the
        end, rolled back on an error. The caller holds `_lock`."""
        self._db.execute("BEGIN IMMEDIATE")
        with self._db:
            yield

    def record(self, rid: str, agent: str, version: dict[str, Any], endpoint: str,
               prompt: list[int], tokens: list[int], logprobs: list[float], text: str,
               finish_reason: str, temperature: float | None = None, top_p: float | None = None,
               allowed: list[int] | None = None, episode: str | None = None,
               tenant: str | None = None) -> None:
        with self._lock:
            self._db.execute(
                f"INSERT INTO interactions ({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (rid, agent, version["version"], version.get("source"),
                 version.get("policy_version"), endpoint, json.dumps(prompt), json.dumps(tokens),
                 json.dumps(logprobs), text, finish_reason, time.time(), temperature, top_p,
                 json.dumps(allowed) if allowed is not None else None, episode, tenant))

    def feedback(self, rid: str, reward: float, comment: str | None = None,
                 tenant: str | None = None) -> int:
        """Attach `reward` to response `rid`, or to every node of episode `rid`; returns how
        many responses got it. With `tenant`, only that tenant's responses can be rewarded
        (another tenant's id reads as unknown)."""
        with self._lock:
            ids = [r[0] for r in self._db.execute(
                "SELECT id FROM interactions WHERE (id=? OR episode=?)"
                + (" AND tenant=?" if tenant is not None else ""),
                (rid, rid) + ((tenant,) if tenant is not None else ()))]
            if not ids:
                raise FeedbackError(404, f"id: no captured response or episode {rid!r}")
            now = time.time()
            try:
                with self._transaction():
                    self._db.executemany("INSERT INTO feedback VALUES (?,?,?,?)",
                                         [(i, reward, comment, now) for i in ids])
            except sqlite3.IntegrityError:
                raise FeedbackError(409, f"id: response {rid!r} already has feedback") from None
            return len(ids)

    def served(self, rid: str) -> list[tuple[str, int, str | None]]:
        """(agent, served version, episode) of response `rid`, or of every node of episode
        `rid`."""
        with self._lock:
            return [(r[0], int(r[1]), r[2]) for r in self._db.execute(
                "SELECT agent, version, episode FROM interactions WHERE id=? OR episode=? "
                "ORDER BY id", (rid, rid))]

    def claim(self, agent: str, n: int, step: int, min_temperature: float = 0.05,
              tenants: list[str] | None = None, learner: str | None = None
              ) -> list[CapturedRow]:
        """The oldest `n` rewarded rows of `agent` not yet consumed, marked consumed (outcome
        "claimed") in the same transaction: durable before any training on them. Rows decoded
        (nearly) greedily are not trainable (their log-probs say nothing about the policy).
        `tenants`: only rows served to these tenants (None: every row). `learner`: whose claims
        journal they go to (`release(learner, ...)`; default `agent`), e.g. a tenant's own
        adapter's learner, which counts its own steps."""
        where, params = _tenant_filter(tenants)
        with self._lock:
            with self._transaction():
                rows = self._db.execute(
                    "SELECT i.id, i.agent, i.version, i.prompt, i.response, i.logprobs, "
                    "i.temperature, i.allowed, f.reward FROM interactions i "
                    "JOIN feedback f ON f.response_id = i.id "
                    "LEFT JOIN consumed c ON c.response_id = i.id "
                    "WHERE i.agent = ? AND c.response_id IS NULL AND i.temperature >= ? "
                    "AND i.response != '[]'" + where + " ORDER BY f.created, i.id LIMIT ?",
                    (agent, min_temperature, *params, n)).fetchall()
                now = time.time()
                self._db.executemany("INSERT INTO consumed VALUES (?,?,?,?,?)",
                                     [(r[0], learner or agent, step, "claimed", now)
                                      for r in rows])
        return [CapturedRow(r[0], r[1], r[2], json.loads(r[3]), json.loads(r[4]),
                            json.loads(r[5]), float(r[6]),
                            json.loads(r[7]) if r[7] is not None else None, float(r[8]))
                for r in rows]

    def available(self, agent: str, min_temperature: float = 0.05,
                  tenants: list[str] | None = None) -> int:
        """Rewarded, trainable rows of `agent` (served to `tenants`) not consumed yet."""
        where, params = _tenant_filter(tenants)
        with self._lock:
            return self._db.execute(
                "SELECT COUNT(*) FROM interactions i JOIN feedback f ON f.response_id = i.id "
                "LEFT JOIN consumed c ON c.response_id = i.id WHERE i.agent = ? AND "
                "c.response_id IS NULL AND i.temperature >= ? AND i.response != '[]'" + where,
                (agent, min_temperature, *params)).fetchone()[0]

    def release(self, agent: str, after_step: int) -> list[str]:
        """Hand back `agent`'s rows claimed at a step after `after_step` (the steps a restored
        training snapshot does not contain: claimed before a crash, or trained into weights the
        crash lost), so the next claims deliver them again; returns their ids."""
        with self._lock:
            with self._transaction():
                ids = [r[0] for r in self._db.execute(
                    "SELECT response_id FROM consumed WHERE agent = ? AND step > ? "
                    "ORDER BY step, response_id", (agent, after_step))]
                self._db.execute("DELETE FROM consumed WHERE agent = ? AND step > ?",
                                 (agent, after_step))
        return ids

    def settle(self, ids: list[str], outcome: str) -> None:
        """What became of claimed rows: "trained", or "kl_stop" (the update was undone)."""
        with self._lock:
            self._db.executemany("UPDATE consumed SET outcome=? WHERE response_id=?",
                                 [(outcome, i) for i in ids])

    def feedback_by_version(self, agent: str, since: float = 0.0,
                            tenants: list[str] | None = None) -> dict[int, tuple[float, int]]:
        """{served version: (mean reward, count)} of `agent`'s responses created since `since`
        (served to `tenants`; None: to anyone)."""
        where, params = _tenant_filter(tenants)
        with self._lock:
            rows = self._db.execute(
                "SELECT i.version, AVG(f.reward), COUNT(*) FROM interactions i JOIN feedback f "
                "ON f.response_id = i.id WHERE i.agent = ? AND i.created >= ?" + where
                + " GROUP BY i.version", (agent, since, *params)).fetchall()
        return {int(v): (float(m), int(n)) for v, m, n in rows}

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM interactions").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
