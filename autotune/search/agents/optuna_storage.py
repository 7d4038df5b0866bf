"""Where an Optuna study lives: a storage that survives a kill and that several processes (on one
machine or many) may share.

The default is ``optuna.journal`` in the working directory: Optuna's ``JournalStorage`` on a file, safe for
several processes; ``journal:PATH`` or any ``*.journal`` path selects one elsewhere; ``sqlite:///x.db``,
``postgresql://...`` or any SQLAlchemy URL is an ``RDBStorage``, PostgreSQL being the one for workers on
several machines; ``memory`` keeps it in memory, for experiments that need no resume. The journal is the
default because Optuna's RDB storage on SQLite costs ~100 ms of ORM work per evaluated plan here, the
journal ~2 ms; a working directory that already holds an ``optuna.db`` from an older autotune (and no
journal) keeps using it, so its searches still resume.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_STORAGE = "optuna.journal"
LEGACY_STORAGE = "sqlite:///optuna.db"


def default_storage() -> str:
    """``optuna.journal``, or the ``optuna.db`` an older autotune left in the working directory."""
    if Path("optuna.db").exists() and not Path(DEFAULT_STORAGE).exists():
        return LEGACY_STORAGE
    return DEFAULT_STORAGE


def _sqlite_path(url: str) -> Path | None:
    prefix = "sqlite:///"
    if not url.startswith(prefix) or ":memory:" in url:
        return None
    return Path(url[len(prefix) :])


def postgres_driver(url: str) -> str:
    """``postgresql://...`` names SQLAlchemy's psycopg2 driver; with only psycopg 3 installed (the dev
    extra's), use it instead. A missing driver is one clear line."""
    import importlib.util

    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("postgresql", "postgres"):
        return url
    if importlib.util.find_spec("psycopg2") is not None:
        return "postgresql://" + rest
    if importlib.util.find_spec("psycopg") is not None:
        return "postgresql+psycopg://" + rest
    from autotune.errors import SpecError

    raise SpecError("--storage", "", "a PostgreSQL storage needs a driver: pip install 'psycopg[binary]' (or psycopg2)")


def _open_rdb(url: str, attempts: int = 6):
    """``RDBStorage(url)``; retried when another process is creating the same tables right now."""
    import optuna
    from sqlalchemy import event

    url = postgres_driver(url)
    path = _sqlite_path(url)
    engine_kwargs: dict[str, Any] = {}
    if path is not None:
        import sqlite3

        path.parent.mkdir(parents=True, exist_ok=True)
        with sqlite3.connect(path, timeout=30) as conn:  # persistent: readers never block the writer
            conn.execute("PRAGMA journal_mode=WAL")
        engine_kwargs = {"connect_args": {"timeout": 30}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    for attempt in range(attempts):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
            break
        except Exception as e:  # noqa: BLE001 - concurrent table creation: retry, then give up loudly
            if (
                attempt == attempts - 1
                or "Can't load plugin" in str(e)
                or isinstance(e, (ImportError, ModuleNotFoundError))
            ):
                raise
            log.info("optuna storage %s not ready (%s); retrying", url, type(e).__name__)
            time.sleep(0.2 * (attempt + 1))
    if path is not None:
        # WAL + synchronous=NORMAL: one fsync per checkpoint instead of several per commit; a
        # killed process loses nothing (the WAL is in the file), only a power cut may lose the
        # last commits (the search then re-evaluates those plans)
        @event.listens_for(storage.engine, "connect")
        def _pragmas(dbapi_conn, _record):  # pragma: no cover - exercised by every sqlite search
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        storage.engine.dispose()
    return storage


def open_storage(storage: str | None):
    """An Optuna storage from a URL: ``sqlite:///x.db`` or any SQLAlchemy URL (RDB),
    ``journal:path`` / ``*.journal`` (journal file) or ``memory``."""
    import optuna
    from optuna.storages import JournalStorage

    url = storage or default_storage()
    if url == "memory":  # no file: experiments that need no resume
        return optuna.storages.InMemoryStorage()
    if url.startswith("journal:") or url.endswith(".journal"):
        path = url.removeprefix("journal:").removeprefix("///") if url.startswith("journal:") else url
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(_journal_backend(path))
    return _open_rdb(url)


#: the journal is flushed to the OS at every write and forced to disk (fsync) at most this often
JOURNAL_FSYNC_EVERY_S = 1.0


def _journal_backend(path: str):
    """Optuna's ``JournalFileBackend`` with Optuna's own lock, but without an fsync per write.

    Optuna's backend fsyncs every log line: ~5 ms each here, four per evaluated plan, a fifth of a
    200-plan simulator search. Each write here still reaches the OS before the call returns (a killed
    search, ``kill -9`` included, loses nothing, and other processes read it at once); only the
    fsync is rationed to one per ``JOURNAL_FSYNC_EVERY_S`` and one when the process exits, so an
    operating-system crash or power cut can lose the last second of writes (the study then resumes
    from before them; MLflow's record is written separately)."""
    import atexit
    import os

    from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

    class RationedSyncBackend(JournalFileBackend):
        def __init__(self, file_path: str) -> None:
            self._autotune_lock = JournalFileSymlinkLock(file_path)
            super().__init__(file_path, lock_obj=self._autotune_lock)
            self._autotune_path = file_path
            self._synced_at = time.monotonic()
            self._dirty = False
            atexit.register(self.sync)

        def append_logs(self, logs: list[dict[str, Any]]) -> None:
            import json

            text = "\n".join(json.dumps(entry, separators=(",", ":")) for entry in logs) + "\n"
            self._autotune_lock.acquire()
            try:
                with open(self._autotune_path, "ab") as f:
                    f.write(text.encode("utf-8"))
                    f.flush()
                    if time.monotonic() - self._synced_at >= JOURNAL_FSYNC_EVERY_S:
                        os.fsync(f.fileno())
                        self._synced_at, self._dirty = time.monotonic(), False
                    else:
                        self._dirty = True
            finally:
                self._autotune_lock.release()

        def sync(self) -> None:
            if self._dirty:
                try:
                    fd = os.open(self._autotune_path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                except OSError as e:  # the file was removed meanwhile: nothing left to keep
                    log.debug("journal fsync at exit: %s", e)
                self._dirty = False

    return RationedSyncBackend(path)
