"""Checks of paths, stores and numbers that run before any work, so a bad one is one line at once
instead of an error after a whole search, a profiling run or a launch.

Each raises ``SpecError(option, "", rule)``: ``--output: directory /x does not exist``. They use
only the standard library (the CLI stays fast) and touch nothing they do not have to: a file that
does not exist yet is not created (its directory is tried with a temporary file), a store is
contacted for at most ``CONNECT_TIMEOUT_S`` seconds.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from autotune.errors import SpecError, shown

CONNECT_TIMEOUT_S = 5.0
MAX_SEED = 2**32 - 1  # numpy's RandomState (Optuna's TPE) takes seeds below 2**32
TRACKING_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "file")
STORAGE_SCHEMES = ("sqlite", "postgresql", "mysql")
_SQLITE_MAGIC = b"SQLite format 3\x00"


def writable_file(path: str | Path, option: str) -> Path:
    """``path`` can be written: not a directory, its directory exists, and a file can be made there."""
    path = Path(path)
    if path.is_dir():
        raise SpecError(option, "", f"{shown(str(path))} is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise SpecError(option, "", f"directory {shown(str(parent))} does not exist")
    try:
        if path.exists():
            with open(path, "ab"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".autotune-check-"):
                pass
    except OSError as e:
        raise SpecError(option, "", f"cannot write {shown(str(path))}: {e.strerror}") from None
    return path


def writable_dir(path: str | Path, option: str) -> Path:
    """``path`` is a directory this process can write (created, with its parents, if missing)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise SpecError(option, "", f"{shown(str(path))} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".autotune-check-"):
            pass
    except OSError as e:
        raise SpecError(option, "", f"cannot write in {shown(str(path))}: {e.strerror}") from None
    return path


def seed(value: int, option: str = "--seed", count: int = 1) -> int:
    """A seed in ``[0, 2**32)`` (``count`` consecutive seeds are used: workers take seed + i)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value + count - 1 > MAX_SEED:
        top = MAX_SEED - count + 1
        raise SpecError(option, "", f"must be an integer from 0 to {top:,}, got {shown(value)}")
    return value


def finite_positive(value: float, option: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SpecError(option, "", f"must be a finite number > 0, got {shown(value)}")
    return float(value)


def port(value: int, option: str = "--port") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise SpecError(option, "", f"must be a TCP port from 1 to 65535, got {shown(value)}")
    return value


def _sqlite_file(uri: str, option: str) -> None:
    """``sqlite:///path``: the path is a new file in an existing directory, or an SQLite database."""
    if uri.split("?", 1)[0] == "sqlite://":  # in memory
        return
    if not uri.startswith("sqlite:///"):
        raise SpecError(option, "", f"{shown(uri)}: an SQLite URL is sqlite:///relative.db or sqlite:////absolute.db")
    rest = uri[len("sqlite:///") :].split("?", 1)[0]
    if rest in ("", ":memory:") or rest.startswith("file::memory:"):
        return
    path = Path(rest)
    if path.is_dir():
        raise SpecError(option, "", f"{shown(str(path))} is a directory, not an SQLite database file")
    if path.exists():
        try:
            with open(path, "rb") as f:
                head = f.read(len(_SQLITE_MAGIC))
        except OSError as e:
            raise SpecError(option, "", f"cannot read {shown(str(path))}: {e.strerror}") from None
        if head and head != _SQLITE_MAGIC:
            raise SpecError(
                option,
                "",
                f"{shown(str(path))} is not an SQLite database (it starts with "
                f"{shown(head[:8])}); give a new file name or a database",
            )
        return
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise SpecError(option, "", f"directory {shown(str(parent))} of the database does not exist")


def _reachable(uri: str, option: str, what: str) -> None:
    """A TCP connection to the URI's host and port opens within ``CONNECT_TIMEOUT_S``."""
    parsed = urlparse(uri)
    defaults = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}
    host = parsed.hostname
    if not host:
        raise SpecError(option, "", f"{shown(uri)} names no host")
    try:
        port_ = parsed.port or defaults.get(parsed.scheme.split("+", 1)[0], 0)
    except ValueError:
        raise SpecError(option, "", f"{shown(uri)} has an invalid port") from None
    try:
        with socket.create_connection((host, port_), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise SpecError(
            option, "", f"no {what} answers at {host}:{port_} ({reason}); start it or give another URI"
        ) from None


def tracking_uri(uri: str | None, option: str = "--tracking-uri") -> None:
    """An MLflow tracking URI autotune can use: a known scheme, an SQLite file that is a database (or
    new), a server or database that accepts a connection."""
    if uri is None:
        return
    if not isinstance(uri, str) or not uri.strip():
        raise SpecError(option, "", f"must be a URI such as sqlite:///mlflow.db, got {shown(uri)}")
    scheme = urlparse(uri).scheme.split("+", 1)[0].lower()
    if scheme == "" or (len(scheme) == 1 and os.name == "nt"):  # a local directory (MLflow's file store)
        path = Path(uri)
        if path.exists() and not path.is_dir():
            raise SpecError(
                option,
                "",
                f"{shown(uri)} is a file; a path means a directory store (or give "
                f"sqlite:///{uri} for an SQLite database)",
            )
        return
    if scheme not in TRACKING_SCHEMES:
        raise SpecError(
            option,
            "",
            f"unsupported scheme {shown(scheme)} in {shown(uri)}; use sqlite:///FILE.db, "
            "postgresql://..., mysql://..., http(s)://HOST:PORT or a directory",
        )
    if scheme == "sqlite":
        _sqlite_file(uri, option)
    elif scheme == "file":
        path = Path(urlparse(uri).path)
        if path.exists() and not path.is_dir():
            raise SpecError(option, "", f"{shown(str(path))} is a file, not a directory store")
    else:
        _reachable(uri, option, "MLflow server" if scheme in ("http", "https") else f"{scheme} server")


def optuna_storage(storage: str | None, option: str = "--storage") -> None:
    """An Optuna storage autotune can open (``autotune.search.agents.optuna_storage.open_storage``)."""
    if storage is None or storage == "memory":
        return
    if not isinstance(storage, str) or not storage.strip():
        raise SpecError(option, "", f"must be a storage URL such as sqlite:///optuna.db, got {shown(storage)}")
    if storage.startswith("journal:") or storage.endswith(".journal"):
        path = Path(storage.removeprefix("journal:").removeprefix("///") if storage.startswith("journal:") else storage)
        if path.is_dir():
            raise SpecError(option, "", f"{shown(str(path))} is a directory, not a journal file")
        return
    scheme = urlparse(storage).scheme.split("+", 1)[0].lower()
    if scheme not in STORAGE_SCHEMES:
        raise SpecError(
            option,
            "",
            f"unsupported storage {shown(storage)}; use sqlite:///FILE.db, "
            "postgresql://..., mysql://..., FILE.journal or memory",
        )
    if scheme == "sqlite":
        _sqlite_file(storage, option)
    else:
        _reachable(storage, option, f"{scheme} server")
