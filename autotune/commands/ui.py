"""``autotune ui``: the MLflow UI for the local store, bound to 127.0.0.1 (runs until Ctrl-C)."""

from __future__ import annotations

import os
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


def run(tracking_uri: str | None, port: int) -> int:
    from rich.console import Console

    cmd = command(tracking_uri, port)
    Console(stderr=True).print(f"MLflow UI on http://127.0.0.1:{port} for {tracking_uri or DEFAULT_TRACKING_URI} "
                               "(Ctrl-C stops it)")
    try:
        env = dict(os.environ)
        env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 0
