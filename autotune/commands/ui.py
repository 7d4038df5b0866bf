"""``autotune ui``: the MLflow UI for the local store, bound to 127.0.0.1 (runs until Ctrl-C).

The port and the store are checked first (one line each). The server runs under
``python -m autotune.lifeline``, which stops it and its uvicorn worker when this command ends, however
it ends (Ctrl-C, SIGTERM, SIGKILL). A server that stops by itself (it could not start, for example)
makes the command exit 1.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from autotune.search.tracking import DEFAULT_TRACKING_URI


def command(tracking_uri: str | None, port: int) -> list[str]:
    uri = tracking_uri or DEFAULT_TRACKING_URI
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    exe = [str(mlflow_bin)] if mlflow_bin.exists() else [sys.executable, "-m", "mlflow"]
    # one web worker and no background job runner: a viewer for a local store, not a shared server
    return [*exe, "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]


def _port_free(port: int) -> None:
    from autotune.errors import SpecError

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise SpecError(
                "--port", "", f"127.0.0.1:{port} is in use ({e.strerror}); pick another port with --port"
            ) from None


def _stop_supervisor(proc: subprocess.Popen) -> None:
    """SIGTERM to the ``autotune.lifeline`` supervisor, which stops the server's process group (no wait:
    called from a signal handler)."""
    if proc.returncode is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def run(tracking_uri: str | None, port: int) -> int:
    from rich.console import Console
    from rich.markup import escape

    from autotune import prechecks
    from autotune.lifeline import child_env

    prechecks.port(port)
    prechecks.tracking_uri(tracking_uri)
    _port_free(port)
    console = Console(stderr=True)
    cmd = [sys.executable, "-m", "autotune.lifeline", *command(tracking_uri, port)]
    console.print(
        escape(
            f"MLflow UI on http://127.0.0.1:{port}/#/?workflowType=machine_learning for "
            f"{tracking_uri or DEFAULT_TRACKING_URI} (Ctrl-C stops it; the link opens on model "
            "training runs, not the GenAI view)"
        )
    )
    env = child_env()
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    from autotune.lifeline import stop_signals_end

    # Ctrl-C (or SIGTERM) to this command: the supervisor is told to stop the server, and this command
    # waits for it and exits 0. A terminal's Ctrl-C reaches the supervisor too; a `kill -INT` of this
    # process alone reaches only this one (it used to wait for ever, the server still listening).
    procs = [subprocess.Popen(cmd, env=env)]
    with stop_signals_end(lambda: _stop_supervisor(procs[0]), reraise=False) as stopped:
        code = procs[0].wait()
    if stopped:
        return 0
    if code >= 128:  # stopped by a signal (SIGTERM, SIGHUP) sent to the supervisor
        return 0
    console.print(
        f"[red]error:[/red] the MLflow UI server stopped by itself (exit code {code}); its output above says why"
    )
    return 1
