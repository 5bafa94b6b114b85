"""Tenants of `flexmarl serve --tenants FILE`: who may call, how often, and whose traffic may
train the served policies.

The file (YAML):

    tenants:
      ops:      {api_key_env: OPS_KEY, admin: true}
      acme:     {api_key: sk-acme, requests_per_minute: 600, requests_per_day: 100000,
                 train: true}
      partner:  {api_key_env: PARTNER_KEY, requests_per_minute: 60}

Each request names its tenant by its key (`Authorization: Bearer KEY`); a wrong or missing key is
answered 401 before anything is read or recorded. Limits are per tenant (a sliding minute and
the UTC day, in the server's memory: a restart starts them afresh), so one tenant at its limit
gets 429 while the others are served. Only `admin: true` tenants may call `/v1/admin/*` (403
otherwise). Every captured interaction carries its tenant; feedback is accepted only from the
tenant that was answered; online learning claims only rows of tenants with `train: true`.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flexmarl.config.schema import ConfigError


class TenantSpec(BaseModel):
    """One tenant as written in the file."""

    model_config = ConfigDict(extra="forbid")

    api_key: str | None = Field(None, min_length=8)
    api_key_env: str | None = Field(None, min_length=1)
    requests_per_minute: int | None = Field(None, ge=1)
    requests_per_day: int | None = Field(None, ge=1)
    admin: bool = False
    train: bool = False  # may this tenant's rewarded traffic train the (shared) online policy

    @model_validator(mode="after")
    def _one_key(self) -> TenantSpec:
        if (self.api_key is None) == (self.api_key_env is None):
            raise ValueError("give exactly one of api_key and api_key_env")
        return self


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, TenantSpec] = Field(min_length=1)


@dataclass
class Tenant:
    """A tenant with its resolved key and its request counters."""

    name: str
    key: bytes
    per_minute: int | None
    per_day: int | None
    admin: bool
    train: bool
    recent: deque[float] = field(default_factory=deque)  # admission times of the last minute
    day: int = -1  # the UTC day `today` counts
    today: int = 0


class RateLimited(Exception):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Tenants:
    """The tenants of one server: key lookup and per-tenant rate limits."""

    def __init__(self, tenants: list[Tenant], source: str = "tenants") -> None:
        self.by_name = {t.name: t for t in tenants}
        self.source = source
        self._lock = threading.Lock()

    @property
    def trainers(self) -> list[str]:
        """Tenants whose rewarded traffic online learning may claim."""
        return [t.name for t in self.by_name.values() if t.train]

    def identify(self, given: str) -> Tenant | None:
        """The tenant whose key is `given` (every key compared in constant time), or None."""
        found = None
        raw = given.encode()
        for t in self.by_name.values():
            if hmac.compare_digest(raw, t.key):
                found = t
        return found

    def admit(self, tenant: Tenant, now: float | None = None) -> None:
        """Count one request of `tenant`, or raise RateLimited (nothing counted then)."""
        now = time.time() if now is None else now
        with self._lock:
            while tenant.recent and tenant.recent[0] <= now - 60.0:
                tenant.recent.popleft()
            day = int(now // 86400)
            if day != tenant.day:
                tenant.day, tenant.today = day, 0
            if tenant.per_day is not None and tenant.today >= tenant.per_day:
                raise RateLimited(f"tenant {tenant.name!r}: daily quota of {tenant.per_day} "
                                  "requests used up (requests_per_day); it renews at 00:00 UTC",
                                  (day + 1) * 86400 - now)
            if tenant.per_minute is not None and len(tenant.recent) >= tenant.per_minute:
                raise RateLimited(f"tenant {tenant.name!r}: over {tenant.per_minute} requests "
                                  "per minute (requests_per_minute)",
                                  tenant.recent[0] + 60.0 - now)
            tenant.recent.append(now)
            tenant.today += 1

    def usage(self) -> dict[str, dict[str, int | None]]:
        now = time.time()
        with self._lock:
            return {t.name: {"last_minute": sum(1 for s in t.recent if s > now - 60.0),
                             "requests_per_minute": t.per_minute,
                             "today": t.today if t.day == int(now // 86400) else 0,
                             "requests_per_day": t.per_day}
                    for t in self.by_name.values()}


def load_tenants(path: str | Path, env: dict[str, str] | None = None) -> Tenants:
    """Read and check a tenants file; a bad one raises ConfigError naming file and field."""
    env = dict(os.environ) if env is None else env
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the tenants file ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not YAML: {str(exc).splitlines()[0]}") from None
    try:
        spec = TenantsFile.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        msg = msg.removeprefix("Value error, ")
        raise ConfigError(f"{p}: {loc}: {msg}") from None
    tenants: list[Tenant] = []
    keys: dict[str, str] = {}
    for name, t in spec.tenants.items():
        key = t.api_key
        if t.api_key_env is not None:
            key = env.get(t.api_key_env)
            if not key:
                raise ConfigError(f"{p}: tenants.{name}.api_key_env: environment variable "
                                  f"{t.api_key_env} is not set")
        assert key is not None  # the validator asked for one of the two
        if key in keys:
            raise ConfigError(f"{p}: tenants.{name}: same API key as tenant {keys[key]!r}")
        keys[key] = name
        tenants.append(Tenant(name, key.encode(), t.requests_per_minute, t.requests_per_day,
                              t.admin, t.train))
    return Tenants(tenants, str(p))
