"""Simulated vs measured: Sailor's MIT runs, consumer GPUs joined by 1 Gbit/s (issue 24's slow links).

Source: ``experiments/data/sailor_mit_runs.json`` (transcribed from eth-easl/sailor's validation plan files;
the file says how the runs were made): OPT-350M in fp32 on nodes of 8 x RTX-3090, 8 x TITAN RTX and 8 x
RTX-2080 joined by ~1 Gbit/s Ethernet, Aceso's Megatron-based runtime: pipelines across nodes, tensor
parallelism inside each node, data-parallel replicas of mixed GPU types, no activation checkpointing,
the gradient all-reduce after the backward. Iterations of 54-120 s, most of them the network.

Nothing is fitted to these runs. Each run is simulated from the datasheet (no profile) on its nodes: the
links the data file gives (Sailor's measured all-reduce bandwidth inside a node, 0.115 GB/s between nodes,
assumed latencies), one pipeline per data-parallel replica with the data file's stages, engine
``megatron``. Time error = simulated / measured - 1; memory against the measured peak (nvidia-smi, the
max over ranks; the simulator's device view). ``mit-N6_D2`` carries ``mit-N3_D1``'s numbers in the source
(see the data file): it is printed but kept out of the means.

    .venv/bin/python experiments/fidelity/sailor_mit.py
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import megatron_comparison as mc  # this folder: the script's own directory is on the path
import sailor_validation as sv

from autotune.loading import cluster_from_dict, model_from_dict
from autotune.simulator import Simulator
from autotune.specs import Measurement, ParallelConfig

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "experiments" / "data" / "sailor_mit_runs.json"
NODE_GPU = {"k": "RTX-3090", "n": "TITAN-RTX", "r": "RTX-2080"}
DUPLICATES = {"mit-N6_D2"}


def cluster(data: dict, run: dict):
    links = data["links"]
    per_node = run["tp"]
    names = sorted({n for stage in run["stage_nodes"] for n in stage})
    return cluster_from_dict(
        {
            "name": f"mit-{len(names)}",
            "nodes": [
                {
                    "name": n,
                    "gpu": NODE_GPU[n[0]],
                    "count": per_node,
                    "intra_node": {
                        "bandwidth_GBps": links["intra_node_GBps"][NODE_GPU[n[0]]][str(per_node)],
                        "latency_us": links["latency_us"]["intra_node"],
                    },
                }
                for n in names
            ],
            "network": {"bandwidth_GBps": links["network_GBps"], "latency_us": links["latency_us"]["network"]},
        },
        "sailor-mit",
    )


def model(run: dict):
    """OPT-350M as Sailor ran it (the GH200 data file's shape, fp32, standard attention, no dropout)."""
    return model_from_dict(sv.model_dict(json.loads(sv.DATA.read_text())["model"], run), "sailor-mit")


def plan(run: dict) -> ParallelConfig:
    """One pipeline per replica r: stage s on the node ``stage_nodes[s][r]``, all its ``tp`` GPUs."""
    return ParallelConfig.from_dict(
        {
            "micro_batch_size": run["micro_batch_size"],
            "pipelines": [
                {
                    "num_microbatches": run["num_microbatches_per_replica"],
                    "stages": [
                        {
                            "devices": [f"{nodes[r]}:{i}" for i in range(run["tp"])],
                            "layers": layers,
                            "recompute": False,
                        }
                        for nodes, layers in zip(run["stage_nodes"], run["layers_per_stage"])
                    ],
                }
                for r in range(run["dp"])
            ],
        }
    )


def results(quick: bool = False) -> list[tuple[dict, Measurement]]:
    data = json.loads(DATA.read_text())
    runs = data["runs"][:3] if quick else data["runs"]
    return [(run, Simulator(cluster(data, run), model(run), engine=mc.ENGINE).evaluate(plan(run))) for run in runs]


def time_rows(quick: bool = False) -> list[tuple[str, float, float]]:
    """(run, time error, expected_error) of the runs that are not duplicates (``error_bars.py`` reads them)."""
    return [
        (run["id"], m.iteration_time_s / run["measured"]["iteration_time_s"] - 1, m.expected_error)
        for run, m in results(quick)
        if m.ok and run["id"] not in DUPLICATES
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first three runs")
    args = ap.parse_args()
    print(
        f"{'run':10s} {'pp':>2s} {'dp':>2s} {'tp':>2s} | {'meas s':>7s} {'sim s':>7s} {'error':>7s} {'bar':>5s} | "
        f"{'meas GiB':>8s} {'sim GiB':>7s} {'error':>7s} | largest error terms"
    )
    t_err, m_err = [], []
    for run, m in results(args.quick):
        meas = run["measured"]
        head = f"{run['id']:10s} {run['pp']:2d} {run['dp']:2d} {run['tp']:2d} | {meas['iteration_time_s']:7.2f} "
        if not m.ok:
            print(head + f"{m.status}: {m.error}")
            continue
        te = m.iteration_time_s / meas["iteration_time_s"] - 1
        me = max(m.peak_memory_GiB.values()) / meas["peak_memory_GiB"] - 1
        dup = run["id"] in DUPLICATES
        if not dup:
            t_err.append(te)
            m_err.append(me)
        print(
            head + f"{m.iteration_time_s:7.2f} {te:+7.1%} {m.expected_error:5.0%} | {meas['peak_memory_GiB']:8.2f} "
            f"{max(m.peak_memory_GiB.values()):7.2f} {me:+7.1%} | "
            + ("(duplicate of mit-N3_D1's numbers) " if dup else "")
            + "; ".join(m.error_terms[:2])
        )
    print(
        f"\n{len(t_err)} runs: time mean |error| {statistics.mean(abs(e) for e in t_err):.1%} "
        f"(signed {statistics.mean(t_err):+.1%}, max {max(abs(e) for e in t_err):.1%}); "
        f"memory mean |error| {statistics.mean(abs(e) for e in m_err):.1%} (signed {statistics.mean(m_err):+.1%})"
    )


if __name__ == "__main__":
    main()
