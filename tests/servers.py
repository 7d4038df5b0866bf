"""Real servers for tests, on loopback and free ports: a PostgreSQL server (Debian's ``postgresql``
package) and an ``mlflow server``. Each is a context manager that starts the server, waits until it
answers, and stops it (and its child processes, by process group id) at the end; each server
process also dies with the test process (``PR_SET_PDEATHSIG``) should pytest itself be killed.

When something a server needs is missing, ``pytest.skip`` says what (pytest's ``-ra`` prints the
reason in CI); ``.ci/run`` installs what it can first.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait_s: float = 30.0) -> None:
    """Stop ``proc`` and everything in its process group (it was started in a session of its own)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # whatever is left of its group (e.g. server workers)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(10)


def wait_for_health(base_url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until ``{base_url}/health`` answers 200 (an MLflow server, ``autotune ui``): True, or False when
    ``proc`` exits or ``timeout_s`` passes first."""
    deadline = time.time() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            return False
        time.sleep(0.5)


def _pg_bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


@contextmanager
def postgres_server() -> Iterator[str]:
    """A fresh PostgreSQL cluster in a temporary directory of its own (its user must be able to reach
    it: pytest's directories are private to root): yields the URL of an empty database."""
    import tempfile

    initdb, postgres = _pg_bin("initdb"), _pg_bin("postgres")
    if not initdb or not postgres:
        pytest.skip("PostgreSQL server not installed (Debian: apt-get install postgresql; .ci/run does it as root)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg not installed (pip install -e '.[dev]')")
    user = None
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root: run it as the package's own user
        try:
            import pwd

            pwd.getpwnam("postgres")
            user = "postgres"
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
    root = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    data, sock = root / "pgdata", root / "pgsock"
    for d in (root, data, sock):
        d.mkdir(parents=True, exist_ok=True)
        if user:
            shutil.chown(d, user)
            os.chmod(d, 0o700)
    subprocess.run(
        [initdb, "-D", str(data), "-A", "trust", "-U", "autotune", "--no-sync"],
        check=True,
        capture_output=True,
        user=user,
        timeout=120,
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            postgres,
            "-D",
            str(data),
            "-p",
            str(port),
            "-k",
            str(sock),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "fsync=off",
            "-c",
            "max_connections=50",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        user=user,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    try:
        import psycopg

        deadline = time.time() + 60
        while True:
            try:
                with psycopg.connect(
                    f"host=127.0.0.1 port={port} user=autotune dbname=postgres", autocommit=True
                ) as conn:
                    conn.execute("CREATE DATABASE optuna")
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"PostgreSQL did not start: {proc.stderr.read().decode()[-2000:]}") from None
                time.sleep(0.3)
        yield f"postgresql://autotune@127.0.0.1:{port}/optuna"
    finally:
        stop(proc, signal.SIGINT)  # SIGINT: PostgreSQL's fast shutdown
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def mlflow_server(root: Path, start_timeout_s: float = 180.0) -> Iterator[str]:
    """``mlflow server`` on a SQLite store in ``root``: yields its http:// tracking URI."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    exe = Path(sys.executable).with_name("mlflow")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mlflow"]
    cmd += [
        "server",
        "--backend-store-uri",
        f"sqlite:///{root}/server.db",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        if not wait_for_health(uri, proc, start_timeout_s):  # 15-30 s on an idle 2-core machine
            log.flush()
            raise RuntimeError(f"mlflow server did not answer /health: {(root / 'server.log').read_text()[-2000:]}")
        yield uri
    finally:
        stop(proc)
        log.close()
