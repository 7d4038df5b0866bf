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
    return [*exe, "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)]


def run(tracking_uri: str | None, port: int) -> int:
    from rich.console import Console

    cmd = command(tracking_uri, port)
    Console(stderr=True).print(f"MLflow UI on http://127.0.0.1:{port} for {tracking_uri or DEFAULT_TRACKING_URI} "
                               "(Ctrl-C stops it)")
    try:
        return subprocess.call(cmd, env=dict(os.environ))
    except KeyboardInterrupt:
        return 0
