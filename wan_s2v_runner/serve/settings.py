"""The server's own settings (:class:`ServerSettings`): what ``wan-s2v serve`` takes beyond the
rank group's spec and every job's defaults, typed and checked once, from the command's values
(:meth:`ServerSettings.from_args`), and held by the server. The rank group's settings are its
:class:`~wan_s2v_runner.shared.spec.GroupSpec`; the flags of both are generated from their
definitions (:mod:`~wan_s2v_runner.launcher.flags`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from wan_s2v_runner.serve.store.protocol import DEFAULT_POOL

LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: a pool's name: short, plain (it is shown, logged and compared)
POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_bind(host: str, token: Optional[str], insecure: bool) -> Optional[str]:
    """Why the server must not start with this address and auth (None: it may)."""
    if host in LOOPBACK or token or insecure:
        return None
    return (f"--host {host} exposes the server beyond this machine with no auth. Fix: add --token TOKEN "
            "(clients send 'Authorization: Bearer TOKEN'), or --insecure-no-auth if the network is yours alone")


class SettingsError(ValueError):
    """The server's settings do not go together (one line: cause and fix)."""


class ServerSettings(BaseModel):
    """``wan-s2v serve``'s settings (its flags' meanings: the README's flags table)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    server_dir: Path
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    token: Optional[str] = None  # resolved from --token-file, --token, $WAN_S2V_TOKEN
    insecure_no_auth: bool = False
    allow_host: tuple[str, ...] = ()
    allow_dir: tuple[Path, ...] = ()
    queue: Optional[str] = None  # postgresql://...; None: SQLite in the server directory
    shared_dir: Optional[Path] = None
    lease_s: int = 30
    pool: str = DEFAULT_POOL
    replicas: int = 1
    max_upload_mb: int = Field(200, ge=1)
    max_audio_s: int = Field(600, ge=1)
    keep_videos: Optional[int] = Field(None, ge=0)
    keep_hours: Optional[int] = Field(None, ge=0)
    min_free_mb: int = Field(1024, ge=0)
    max_queue: int = Field(1000, ge=1)
    json_output: bool = False
    skip_preflight: bool = False
    #: a live session that hears from no client for this long is ended (its recording kept)
    session_idle_s: float = Field(30.0, gt=0)

    @classmethod
    def from_args(cls, args) -> "ServerSettings":
        """The settings of a parsed ``wan-s2v serve`` command line; :class:`SettingsError` (one
        line) when they do not go together (see :meth:`refusal`)."""
        from pydantic import ValidationError

        from wan_s2v_runner.serve.bearer import TokenError, token_of

        try:
            token = token_of(args)
        except TokenError as e:
            raise SettingsError(str(e)) from None
        values = {"server_dir": args.server_dir.expanduser().absolute(), "host": args.host, "port": args.port,
                  "token": token, "insecure_no_auth": args.insecure_no_auth, "allow_host": tuple(args.allow_host),
                  "allow_dir": tuple(p.expanduser().resolve() for p in args.allow_dir), "queue": args.queue,
                  "shared_dir": args.shared_dir.expanduser().absolute() if args.shared_dir else None,
                  "lease_s": args.lease_s, "pool": args.pool, "replicas": args.replicas,
                  "max_upload_mb": args.max_upload_mb, "max_audio_s": args.max_audio_s,
                  "keep_videos": args.keep_videos, "keep_hours": args.keep_hours, "min_free_mb": args.min_free_mb,
                  "max_queue": args.max_queue, "json_output": args.json, "skip_preflight": args.skip_preflight,
                  "session_idle_s": args.session_idle}
        try:
            settings = cls(**values)
        except ValidationError as e:
            err = e.errors()[0]
            name = "--" + str(err["loc"][0]).replace("_", "-")
            raise SettingsError(f"{name} {values.get(err['loc'][0])!r}: {err['msg']}. Fix: see wan-s2v serve "
                                "--help") from None
        why = settings.refusal()
        if why:
            raise SettingsError(why)
        return settings

    def refusal(self) -> Optional[str]:
        """Why these settings do not go together (None: they do)."""
        why = check_bind(self.host, self.token, self.insecure_no_auth)
        if why:
            return why
        if not POOL_NAME.match(self.pool):
            return (f"--pool {self.pool!r}: a name of letters, digits, '.', '_' and '-' (64 at most). Fix: --pool "
                    "lora-a")
        if not self.queue:
            return ("--shared-dir is for a shared --queue (postgresql://...). Fix: drop it, or add --queue"
                    if self.shared_dir else None)
        if not self.queue.startswith(("postgresql://", "postgres://")):
            return f"--queue {self.queue!r}: a postgresql:// URL. Fix: --queue postgresql://USER@HOST/DB, or drop it"
        if not self.shared_dir:
            return ("--queue postgresql://... needs --shared-dir DIR: the directory every server mounts for uploads, "
                    "videos and clip checkpoints (docs/fleet.md)")
        if self.lease_s < 3:
            return f"--lease-s {self.lease_s}: at least 3 (the heartbeat renews it every third). Fix: --lease-s 30"
        try:
            import psycopg  # noqa: F401
            import psycopg_pool  # noqa: F401
        except ImportError:
            return "--queue postgresql://... needs psycopg 3 and its pool. Fix: pip install 'psycopg[binary,pool]'"
        return None

    @property
    def max_age_s(self) -> Optional[float]:
        return self.keep_hours * 3600.0 if self.keep_hours is not None else None
