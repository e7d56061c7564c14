"""A throwaway PostgreSQL cluster for the shared-queue tests: Debian's ``postgresql`` package
(``tools/ensure_postgresql`` installs it where it can), ``initdb`` into a temporary directory and
``pg_ctl`` on a free loopback port. PostgreSQL refuses to run as root, and these machines run
the tests as root: then the cluster runs as the ``postgres`` user the package creates (else
``nobody``). :func:`start` says why not (a one-line reason to skip with) where it cannot run."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from ports import named_port


def _bin_dir() -> Optional[Path]:
    found = shutil.which("pg_ctl")
    if found:
        return Path(os.path.realpath(found)).parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(Path(d).parent.name))
    return Path(dirs[-1]) if dirs and (Path(dirs[-1]) / "pg_ctl").is_file() else None



@dataclass
class Cluster:
    bin: Path
    data: Path
    port: int
    user: Optional[pwd.struct_passwd]  # who runs it (root runs the tests: not root)

    @property
    def url(self) -> str:
        return f"postgresql://wan@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        kw = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []} if self.user else {}
        return subprocess.run([str(self.bin / args[0]), *args[1:]], capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL, cwd=self.data.parent, **kw)

    def database(self) -> str:
        """A new, empty database in the cluster: its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url, autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def halt(self) -> None:
        """The database goes away (as a crash or a failover does: immediate stop, every connection cut)."""
        out = self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        assert out.returncode == 0, out.stderr

    def start(self) -> None:
        """The database back, on the same port and data."""
        opts = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c max_connections=200"
        out = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.data / "server.log"), "-o", opts, "-w", "start")
        assert out.returncode == 0, out.stderr

    def restart(self) -> None:
        self.halt()
        self.start()

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.data.parent, ignore_errors=True)


def start() -> Union[Cluster, str]:
    """A running cluster, or why there is none (one line)."""
    bin_dir = _bin_dir()
    if bin_dir is None:
        return ("no PostgreSQL here (initdb, pg_ctl): tools/ensure_postgresql installs Debian's postgresql "
                "where it can")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "no psycopg 3 here (requirements.txt installs it)"
    user = None
    if os.geteuid() == 0:
        for name in ("postgres", "nobody"):
            try:
                user = pwd.getpwnam(name)
                break
            except KeyError:
                continue
        if user is None:
            return "running as root and no unprivileged user (postgres, nobody) to run PostgreSQL as"
    root = Path(tempfile.mkdtemp(prefix="wan-s2v-pg-"))
    data = root / "data"
    data.mkdir(mode=0o700)
    if user is not None:
        for p in (root, data):
            os.chown(p, user.pw_uid, user.pw_gid)
    cluster = Cluster(bin_dir, data, named_port(), user)
    init = cluster._run("initdb", "-D", str(data), "-U", "wan", "--auth=trust", "-E", "UTF8", "--no-locale")
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        return f"initdb failed: {(init.stderr or init.stdout).strip().splitlines()[-1:]}"
    opts = f"-p {cluster.port} -k {data} -c listen_addresses=127.0.0.1 -c max_connections=200"
    up = cluster._run("pg_ctl", "-D", str(data), "-l", str(data / "server.log"), "-o", opts, "-w", "start")
    if up.returncode != 0:
        log = (data / "server.log").read_text() if (data / "server.log").is_file() else up.stderr
        shutil.rmtree(root, ignore_errors=True)
        return f"pg_ctl start failed: {log.strip().splitlines()[-1:]}"
    return cluster
