"""How fast a search and the library's ``simulate`` are, as a user runs them (issue 15's targets).

1. ``autotune search --cluster mixed-a100-v100 --model gpt2-xl --method optuna --budget 200`` with
   MLflow tracking (the defaults: ``sqlite:///mlflow.db``, ``optuna.journal``), in a fresh working
   directory, run as a subprocess on a pseudo-terminal (so the progress bar draws as a user sees it):
   wall time, CPU time of the whole process tree, time to the first character on the terminal.
   Run ``--runs`` times; the first run may build the cached empty MLflow store
   (``~/.cache/autotune``) that later fresh stores are copied from: ``--cold-cache`` points
   ``XDG_CACHE_HOME`` at an empty directory for every run, so each one pays for MLflow's schema
   migrations as the first search on a machine does.
2. ``autotune.simulate(cluster_path, model_path, config_path)`` in a loop (the same three files):
   calls per second, and for reference ``Simulator.evaluate`` on a reused simulator.

Targets: search < 20 s; simulate >= 3,000 calls/s. Prints the load average: the machine is shared.

    .venv/bin/python experiments/speed/bench_search.py [--runs 3] [--cold-cache] [--budget 200]
    .venv/bin/python experiments/speed/bench_search.py --against 61c44b6 [--methods optuna,rl,dp] [--runs 3]

``--against COMMIT`` times the search of this tree and of that commit side by side, alternating runs
(``against.py``), the best of each.
"""

from __future__ import annotations

import argparse
import os
import pty
import resource
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from against import PREVIOUS_RELEASE, alternate

ROOT = Path(__file__).resolve().parents[2]
MODEL_YAML = """name: llama2-7b
num_layers: 32
hidden_size: 4096
num_heads: 32
ffn_hidden_size: 11008
mlp: swiglu
vocab_size: 32000
seq_len: 4096
global_batch_size: 128
"""


def timed_search(budget: int, cold_cache: bool, tree: Path = ROOT, method: str = "optuna") -> dict:
    """One search as a user runs it, with ``tree``'s autotune (another commit's, for ``--against``)."""
    with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
        env = dict(os.environ, PYTHONPATH=str(tree), COLUMNS="120")
        if cold_cache:
            env["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")
        cmd = [
            str(Path(sys.executable).with_name("autotune")),
            "search",
            "--cluster",
            "mixed-a100-v100",
            "--model",
            "gpt2-xl",
            "--method",
            method,
            "--budget",
            str(budget),
        ]
        master, slave = pty.openpty()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, close_fds=True
        )
        os.close(slave)
        first = None
        while True:
            ready, _, _ = select.select([master], [], [], 0.05)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    chunk = b""
                if chunk and first is None:
                    first = time.monotonic() - t0
                if not chunk and proc.poll() is not None:
                    break
            elif proc.poll() is not None:
                break
        out = proc.stdout.read().decode()
        proc.wait()
        wall = time.monotonic() - t0
        os.close(master)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if proc.returncode != 0:
            raise SystemExit(f"search failed ({proc.returncode}):\n{out[-2000:]}")
        best = next((line for line in out.splitlines() if "tokens/s" in line), "").strip()
        return {"wall_s": wall, "cpu_s": cpu, "first_output_s": first or float("nan"), "best": best}


def simulate_rate(seconds: float = 3.0) -> tuple[float, float]:
    import autotune
    from autotune.simulator import Simulator

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama2-7b.yaml"
        model.write_text(MODEL_YAML)
        cluster, config = str(ROOT / "examples/cluster.yaml"), str(ROOT / "examples/llama2-7b-config.json")
        autotune.simulate(cluster, str(model), config)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            autotune.simulate(cluster, str(model), config)
            n += 1
        lib = n / (time.perf_counter() - t0)
        sim = Simulator(autotune.load_cluster(cluster), autotune.load_model(str(model)))
        cfg = autotune.load_config(config)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            sim.evaluate(cfg)
            n += 1
        return lib, n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget", type=int, default=200)
    ap.add_argument("--cold-cache", action="store_true", help="every run builds MLflow's schema itself")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    ap.add_argument("--against", metavar="COMMIT", help=f"side by side with that commit (e.g. {PREVIOUS_RELEASE})")
    ap.add_argument("--methods", default="optuna", help="--against: comma-separated methods to time (optuna,rl,dp)")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.budget = 1, 10
    if args.against:
        print(f"load average before: {os.getloadavg()[0]:.2f} (2 cores); wall seconds, lower is better")
        for method in args.methods.split(","):
            alternate(
                args.against,
                args.runs,
                lambda tree, m=method: timed_search(args.budget, args.cold_cache, tree, m)["wall_s"],
                f"search --method {method} --budget {args.budget}",
                higher_is_better=False,
            )
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        return
    print(f"load average before: {os.getloadavg()[0]:.2f} (2 cores)")
    rows = []
    for i in range(args.runs):
        r = timed_search(args.budget, args.cold_cache)
        rows.append(r)
        print(
            f"search --budget {args.budget} run {i + 1}: wall {r['wall_s']:.1f} s, cpu {r['cpu_s']:.1f} s, "
            f"first output after {r['first_output_s']:.2f} s   [{r['best']}]",
            flush=True,
        )
    walls = sorted(r["wall_s"] for r in rows)
    print(f"search wall time: median {walls[len(walls) // 2]:.1f} s, min {walls[0]:.1f} s (target < 20 s)")
    lib, sim = simulate_rate()
    print(
        f"autotune.simulate(path, path, path): {lib:,.0f} calls/s (target >= 3,000); "
        f"Simulator.evaluate reused: {sim:,.0f} calls/s"
    )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
