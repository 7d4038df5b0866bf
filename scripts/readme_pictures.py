"""The README's pictures: a search's two plots and screenshots of the MLflow UI, as a user sees them.

1. Three simulator searches on ``mixed-h100-a100-32`` / ``llama2-13b`` (``optuna``, ``uniform``,
   ``random``, ``--budget 60`` each) into a fresh MLflow store in a temporary directory.
2. The optuna search's parent-run artifacts ``search_progress.png`` and ``best_timeline.png``,
   downloaded from MLflow into ``docs/``.
3. ``autotune ui`` on that store, and headless Chromium (Debian: ``apt-get install chromium``)
   screenshots of the experiment page, the optuna parent run and the compare view of the three
   parent runs, into ``docs/mlflow_*.png``. Without Chromium the plots are still written and the
   script says so.

    .venv/bin/python scripts/readme_pictures.py [--out docs] [--budget 60]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER, MODEL = "mixed-h100-a100-32", "llama2-13b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def screenshot(browser: str, url: str, path: Path, width: int = 1600, height: int = 1000, wait_ms: int = 25000) -> None:
    """One page, rendered by headless Chromium after ``wait_ms`` of virtual time (the UI loads its runs)."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        cmd = [
            browser,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            f"--virtual-time-budget={wait_ms}",
            f"--screenshot={path}",
            url,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        if r.returncode != 0 or not path.exists():
            raise SystemExit(f"chromium failed on {url}: {r.stderr[-1500:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    ap.add_argument("--budget", type=int, default=60)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from mlflow.tracking import MlflowClient

    from autotune.search.api import tune
    from autotune.search.result import MLFLOW_UI_TRAINING_VIEW

    with tempfile.TemporaryDirectory(prefix="readme-pictures-") as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        results = {}
        for method in ("optuna", "uniform", "random"):
            t0 = time.monotonic()
            results[method] = tune(
                CLUSTER,
                MODEL,
                method=method,
                budget=args.budget,
                seed=0,
                tracking_uri=uri,
                storage=f"{tmp}/optuna.journal",
            )
            r = results[method]
            print(
                f"{method}: best {r.best_measurement.tokens_per_s:,.0f} tokens/s in {r.evaluations} evaluations "
                f"({time.monotonic() - t0:.1f} s)",
                flush=True,
            )
        client = MlflowClient(uri)
        best = results["optuna"]
        for name in ("search_progress.png", "best_timeline.png"):
            local = client.download_artifacts(best.run_id, name, tmp)
            shutil.copy(local, args.out / name)
            print(f"wrote {args.out / name}")

        browser = chromium()
        if browser is None:
            print("no chromium on PATH (Debian: apt-get install chromium): MLflow screenshots skipped")
            return
        port = free_port()
        ui = subprocess.Popen(
            [str(Path(sys.executable).with_name("autotune")), "ui", "--tracking-uri", uri, "--port", str(port)],
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 240
            while True:
                try:
                    with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    pass
                if ui.poll() is not None or time.time() > deadline:
                    raise SystemExit("autotune ui did not answer /health")
                time.sleep(0.5)
            exp = best.experiment_id
            runs = json.dumps([results[m].run_id for m in ("optuna", "uniform", "random")])
            pages = {
                "mlflow_experiment.png": f"{base}/#/experiments/{exp}?{MLFLOW_UI_TRAINING_VIEW}",
                "mlflow_parent_run.png": best.run_url.replace("http://127.0.0.1:5000", base),
                "mlflow_compare.png": f"{base}/#/compare-runs?runs={urllib.parse.quote(runs)}"
                f"&experiments={urllib.parse.quote(json.dumps([exp]))}"
                f"&{MLFLOW_UI_TRAINING_VIEW}",
            }
            for name, url in pages.items():
                t0 = time.monotonic()
                screenshot(browser, url, args.out / name)
                print(f"wrote {args.out / name} ({url}, {time.monotonic() - t0:.1f} s)", flush=True)
        finally:
            os.killpg(ui.pid, signal.SIGTERM)  # autotune ui's lifeline stops the MLflow server with it
            try:
                ui.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(ui.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
