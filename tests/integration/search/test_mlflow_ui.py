"""The MLflow UI shows the comparison a user opens it for, checked in headless Chromium as
``scripts/readme_pictures.py`` renders it: the experiment page of a 4-search experiment (more runs than the
UI's first page of 100) lists every search, and the compare view of the searches opens on
``best_tokens_per_s``. Skipped without Chromium (``.ci/run`` installs Debian's)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request

import pytest
from paths import REPO
from servers import free_port, stop, wait_for_health

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (Debian: apt-get install chromium)"),
]
#: the searches, oldest first: the newest alone has more plans than the UI's first page of 100 runs (the UI
#: lists runs newest first, so before plans were dated back it showed that search and none of the others)
SEARCHES = (("uniform", 30), ("dp", 10), ("optuna", 30), ("random", 110))


def _dom(url: str) -> str:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--window-size=1600,1400",
            "--virtual-time-budget=25000",
        ]
        r = subprocess.run([CHROMIUM, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_the_experiment_page_lists_every_search_and_compare_opens_on_best_tokens_per_s(tmp_path):
    from mlflow.tracking import MlflowClient

    from autotune.search.api import tune
    from autotune.search.result import MLFLOW_UI_TRAINING_VIEW

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    results = [
        tune(
            "mixed-a100-v100",
            "gpt2-xl",
            method=m,
            budget=b,
            tracking_uri=uri,
            storage=f"{tmp_path}/optuna.journal",
        )
        for m, b in SEARCHES
    ]
    client = MlflowClient(uri)
    exp = results[0].experiment_id
    assert len(client.search_runs([exp], max_results=1000)) > 100
    port = free_port()
    ui = subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", "ui", "--tracking-uri", uri, "--port", str(port)],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_for_health(base, ui, 240), "autotune ui did not answer /health"
        page = _dom(f"{base}/#/experiments/{exp}?{MLFLOW_UI_TRAINING_VIEW}")
        shown = set(re.findall(r"(optuna|random|uniform|dp), \d+ plans, seed 0 \(simulator\)", page))
        assert shown == {m for m, _ in SEARCHES}, f"searches on the experiment page: {sorted(shown)}"
        runs = urllib.parse.quote(json.dumps([r.run_id for r in results]))
        compare = _dom(
            f"{base}/#/compare-runs?runs={runs}&experiments={urllib.parse.quote(json.dumps([exp]))}"
            f"&{MLFLOW_UI_TRAINING_VIEW}"
        )
        selected = re.sub(r"<[^>]*>", " ", compare[compare.index("Metrics:") :][:4000]).split()
        assert selected[1] == "best_tokens_per_s", selected[:6]
    finally:
        stop(ui)
