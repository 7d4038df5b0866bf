"""The error bars' table, recomputed from its sources, and how well the bars cover measured runs.

``autotune.simulator.error_bar`` gives every prediction an ``expected_error`` built from one relative
error per (GPU family, precision regime). This script recomputes each of them from the published or
measured runs in this repository, as the mean |relative error of the iteration time| (a throughput
ratio r becomes the time error 1/r - 1), and prints them beside the constants the simulator uses:

- A100 16-bit: Megatron-LM on Selene (Narayanan et al. 2021 Table 1, 1F1B rows; Korthikanti et al. 2022),
  ``megatron_comparison.py``'s plans; and Megatron-LM's README of 2020 (DGX-A100, GPT 1.2B-8.7B, tensor and
  128-way data parallelism; ``megatron_readme.py``);
- A100 fp32, V100 fp32: Sailor's measured per-layer times (OPT-350M, fp32, unfused attention; forward +
  backward of one block per micro-batch size and tp), ``experiments/data/sailor_a100_v100.json``;
- GH200 fp32: Sailor's GPT-Neo-2.7B runs, held out of the GH200 fits (``sailor_validation.py``);
- V100 16-bit: ZeRO-Offload (Ren et al. 2021): PyTorch alone, 1.4B on one V100-32GB, 30 TFLOP/s
  published (``zero_offload.py``'s plan); and Megatron-LM's README of 2020 (one DGX-2, GPT 1.2B-8.7B on 1-8
  V100s; ``megatron_readme.py``). The two disagree by an order of magnitude (62% and 5%): the same class
  trained by a tuned engine and by a plain PyTorch baseline;
- the network at ~1 Gbit/s: Sailor's MIT runs (consumer GPUs, pipelines and data-parallel rings across 1 Gbit/s;
  ``sailor_mit.py``);
- RTX-4090 16-bit: RoundPipe's published throughput on 1-8 x RTX-4090 (``roundpipe_published.py``), simulated as
  the runs trained: fp16 with fp16 accumulation (twice the catalog's tensor rate).

A class with several sources gets the mean of the sources' mean |error|: each source counts once, however
many rows it has (a source's rows share its software and setup, so they are not independent).

torchtitan's published FSDP2 runs (A100-80GB and H100, ``torchtitan_published.py``) set no constant:
their coverage row is the held-out check of the A100 16-bit bar and of the unvalidated-class default.
Nor do the runs measured on one H200 (``experiments/data/h200_gpu_check/runs.json``: autotune's own
runner, eager PyTorch, GPT 125M and gpt2-xl at micro-batch 1-8; and two roundpipe plans through the
``roundpipe`` library): they check the unvalidated-class default on a GPU with no published run.

Then the coverage: for every end-to-end run above, whether |time error| <= the prediction's own
``expected_error``. A bar that is the mean |error| of normally spread errors covers ~58% of runs; far
less means the bars are too narrow. The constants were set from these same sources (in-sample), so the
coverage checks the propagation through the schedule, not the constants' generality.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "experiments" / "quality"))
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
import megatron_comparison as mc  # noqa: E402
import megatron_readme as mr  # noqa: E402
import roundpipe_published as rp  # noqa: E402
import sailor_mit as smit  # noqa: E402
import sailor_planner_comparison as spc  # noqa: E402
import sailor_validation as sv  # noqa: E402
import torchtitan_published as tt  # noqa: E402
import zero_offload as zo  # noqa: E402

from autotune.loading import load_model, model_from_dict  # noqa: E402
from autotune.simulator import Simulator  # noqa: E402
from autotune.simulator.error_bar import (  # noqa: E402
    DATASHEET_TIME_ERROR,
    NETWORK_ERROR_SLOW,
    UNVALIDATED_TIME_ERROR,
    NETWORK_SLOW_GBps,
)
from autotune.simulator.flops import megatron_flops_per_iteration  # noqa: E402
from autotune.specs import ParallelConfig  # noqa: E402


def megatron(quick: bool) -> list[tuple[str, float, float]]:
    """(run, time error, expected_error) of the Megatron-LM rows (time error = published / simulated rate - 1)."""
    out = []
    rows = mc.TABLE_1[:4] if quick else mc.TABLE_1
    for params, heads, hidden, layers, tp, pp, gpus, batch, published, _ in rows:
        model = mc.gpt(params, heads, hidden, layers, batch, "fp16", "table-1")
        cluster = mc.selene(gpus)
        m = Simulator(cluster, model, engine=mc.ENGINE).evaluate(mc.plan(cluster, layers, tp, pp, batch, "1f1b", 1))
        if m.ok:
            rate = megatron_flops_per_iteration(model, recompute=True) / m.iteration_time_s / gpus / 1e12
            out.append((f"narayanan-{params:g}B", published / rate - 1, m.expected_error))
    for params, heads, hidden, layers, tp, pp, gpus, batch, mbs, mfu_pub, _ in [] if quick else mc.KORTHIKANTI:
        model = mc.gpt(params, heads, hidden, layers, batch, "bf16", "korthikanti")
        cluster = mc.selene(gpus)
        m = Simulator(cluster, model, engine=mc.ENGINE).evaluate(
            mc.plan(cluster, layers, tp, pp, batch, "1f1b", 1, mbs, "selective", True)
        )
        if m.ok:
            mfu = megatron_flops_per_iteration(model, recompute=False) / (m.iteration_time_s * gpus * 312e12)
            out.append((f"korthikanti-{params}B", mfu / (mfu_pub / 100) - 1, m.expected_error))
    return out


def megatron_readme(quick: bool) -> dict[str, list[tuple[str, float, float]]]:
    """GPU -> (run, time error, expected_error) of Megatron-LM's 2020 README runs."""
    out: dict[str, list[tuple[str, float, float]]] = {}
    for section, case, measured, simulated, bar in mr.rows(quick):
        gpu = "V100" if "V100" in section else "A100"
        out.setdefault(gpu, []).append((f"{section} {case}", simulated / measured - 1, bar))
    return out


def sailor_layers() -> dict[str, list[float]]:
    """Per GPU: the datasheet block time (forward + backward) against Sailor's measured one, per entry."""
    data = json.loads((ROOT / "experiments" / "data" / "sailor_a100_v100.json").read_text())
    model = model_from_dict(spc.MODEL, "sailor")
    sim = Simulator(spc.cluster(data, 8, 8), model, engine=sv.ENGINE)
    out: dict[str, list[float]] = {}
    for e in data["sailor_layer_profiles"]["entries"]:
        if e["tp"] > spc.GPN:  # a tensor-parallel group larger than a node of Sailor's cluster
            continue
        node = ("a100" if e["gpu"].startswith("A100") else "v100") + "-0"
        devices = tuple(f"{node}:{i}" for i in range(e["tp"]))
        c = sim.costs
        lf, lb, *_ = c.layer_costs(
            c.rate_key[devices[0]],
            e["tp"],
            e["micro_batch_size"],
            c.node[devices[0]].intra_node,
            False,
            1,
            c.group_kind(devices),
        )
        out.setdefault(e["gpu"], []).append((lf + lb) / (e["layer_forward_s"] + e["layer_backward_s"]) - 1)
    return out


def sailor_runs() -> list[dict]:
    """Sailor's GH200 runs (no profile): ``section``, ``run``, ``time_error``, ``bar``, ``memory_error`` (peak
    against the device reading) and Sailor's own simulator's ``sailor_time_error`` / ``sailor_memory_error``."""
    data = json.loads(sv.DATA.read_text())
    out = []
    for section, model, run in sv.runs(data):
        gpn = data["clusters"][run.get("cluster", "clariden-gh200")]["gpus_per_node"]
        cluster = sv.cluster_from(sv.cluster_dict(data, run))
        m = Simulator(cluster, model_from_dict(sv.model_dict(model, run), "data"), engine=sv.ENGINE).evaluate(
            ParallelConfig.from_dict(sv.config_dict(run, gpn))
        )
        if m.ok:
            measured, sailor = run["measured"], run["sailor_predicted"]
            out.append(
                dict(
                    section=section,
                    run=run["id"],
                    time_error=m.iteration_time_s / measured["iteration_time_s"] - 1,
                    bar=m.expected_error,
                    memory_error=max(m.peak_memory_GiB.values()) / measured["peak_memory_GiB"] - 1,
                    sailor_time_error=sailor["iteration_time_s"] / measured["iteration_time_s"] - 1,
                    sailor_memory_error=sailor["peak_memory_GiB"] / measured["peak_memory_GiB"] - 1,
                )
            )
    return out


def sailor_section(sailor: list[dict], section: str) -> list[tuple[str, float, float]]:
    """(run, time error, expected_error) of one section of ``sailor_runs``."""
    return [(r["run"], r["time_error"], r["bar"]) for r in sailor if r["section"] == section]


def v100_16bit() -> list[tuple[str, float, float]]:
    """ZeRO-Offload's PyTorch-alone baseline: 1.4B GPT-2 on one V100-32GB, 30 TFLOP/s published."""
    from autotune.loading import cluster_from_dict

    cluster = cluster_from_dict(zo.DGX2_V100, "dgx2")
    small = model_from_dict(zo.gpt2(26, 2048, 16, 512, "gpt2-1.4b"), "1.4B")
    for mbs in (16, 8, 4, 2, 1):  # the largest micro-batch that fits, as zero_offload.py
        m = Simulator(cluster, small, engine="deepspeed").evaluate(zo.single_gpu_plan(26, mbs, 512 // mbs, "none"))
        if m.ok:
            rate = megatron_flops_per_iteration(small, recompute=True) / m.iteration_time_s / 1e12
            return [("zero-offload-pytorch-1.4B", 30.0 / rate - 1, m.expected_error)]
    return []


def roundpipe(quick: bool) -> list[tuple[str, float, float]]:
    out = []
    for name, published in rp.SCALING.items():
        for seq in (2048,) if quick else (2048, 4096, 8192):
            model = replace(load_model(name), seq_len=seq, global_batch_size=64)
            for k, pub in published.items():
                _, m = rp.roundpipe_default(rp.node(k), model)
                if m is not None and m.ok:
                    out.append((f"{name}-s{seq}-x{k}", pub / m.tokens_per_s - 1, m.expected_error))
    return out


H200_RUNS = ROOT / "experiments" / "data" / "h200_gpu_check" / "runs.json"


def h200_runs() -> tuple[
    list[tuple[str, float, float]], list[tuple[str, float, float]], list[tuple[str, float, float]]
]:
    """(runner rows, roundpipe rows, runner memory rows) of the runs measured on one H200, each simulated
    again now from the datasheet (time error = simulated / measured iteration time - 1; memory rows: the
    allocator view's and the device view's error against ``max_memory_allocated`` and the device reading)."""
    from autotune.loading import cluster_from_dict, load_cluster
    from autotune.planning.space import SearchSpace

    data = json.loads(H200_RUNS.read_text())
    models = {k: model_from_dict(v, k) for k, v in data["models"].items()}
    single = cluster_from_dict(data["cluster_single"], "gpu-check")
    runner, memory = [], []
    for run in data["runner_runs"]:
        model, plan = models[run["model"]], data["plans"][run["plan"]]
        config = ParallelConfig.from_dict(
            gpu_check.single_gpu_plan(data["models"][run["model"]], plan["micro_batch_size"], plan["recompute"])
        )
        m = Simulator(single, model).evaluate(config)
        runner.append(
            (f"{run['model']} {run['plan']}", m.iteration_time_s / run["iteration_time_s"] - 1, m.expected_error)
        )
        if "allocated_memory_GiB" in run:
            memory.append(
                (
                    f"{run['model']} {run['plan']}",
                    max(m.allocated_memory_GiB.values()) / run["allocated_memory_GiB"] - 1,
                    max(m.peak_memory_GiB.values()) / run["peak_memory_GiB"] - 1,
                )
            )
    local = load_cluster(H200_RUNS.parent / "local-cluster.json")
    rpipe = []
    for run in data["roundpipe_runs"]:
        model = models[run["model"]]
        space = SearchSpace(local, model)
        config = space.decode(space.roundpipe_start()).config
        assert config.describe() == run["plan"], (config.describe(), run["plan"])  # the plan that ran
        m = Simulator(local, model).evaluate(config)
        rpipe.append((f"roundpipe {run['model']}", m.iteration_time_s / run["iteration_time_s"] - 1, m.expected_error))
    return runner, rpipe, memory


def mean_abs(xs) -> float:
    xs = list(xs)
    return statistics.mean(abs(x) for x in xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rows (tests/integration/experiments runs it)")
    args = ap.parse_args()
    meg = megatron(args.quick)
    readme = megatron_readme(args.quick)
    layers = sailor_layers()
    sailor = sailor_runs()
    neo = sailor_section(sailor, "sailor_gh200_gptneo")
    v100 = v100_16bit()
    rpipe = roundpipe(args.quick)
    h200_runner, h200_roundpipe, h200_memory = h200_runs()
    table = [
        (("A100", "16-bit"), "Megatron-LM Table 1 + Korthikanti (end to end)", [e for _, e, _ in meg]),
        (("A100", "16-bit"), "Megatron-LM README 2020, DGX-A100 (end to end)", [e for _, e, _ in readme["A100"]]),
        (("A100", "fp32"), "Sailor A100-40GB block times", layers.get("A100-40GB", [])),
        (("V100", "fp32"), "Sailor V100-16GB block times", layers.get("V100-16GB", [])),
        (("V100", "16-bit"), "ZeRO-Offload PyTorch 1.4B (end to end)", [e for _, e, _ in v100]),
        (("V100", "16-bit"), "Megatron-LM README 2020, DGX-2 (end to end)", [e for _, e, _ in readme["V100"]]),
        (("GH200", "fp32"), "Sailor GPT-Neo-2.7B runs, held out (end to end)", [e for _, e, _ in neo]),
        (("RTX-4090", "16-bit"), "RoundPipe published, as run: fp16 accumulation", [e for _, e, _ in rpipe]),
    ]
    print(f"{'family':9s} {'regime':7s} {'source':50s} {'n':>3s} {'mean |time err|':>16s} {'in error_bar.py':>16s}")
    for i, (key, source, errors) in enumerate(table):
        print(f"{key[0]:9s} {key[1]:7s} {source:50s} {len(errors):3d} {100 * mean_abs(errors):15.1f}%")
        if i + 1 < len(table) and table[i + 1][0] == key:
            continue  # the class's last source prints the class's value
        pooled = statistics.mean(mean_abs(e) for k, _, e in table if k == key)
        const = DATASHEET_TIME_ERROR.get(key)
        # the constants hold the full run's values: a --quick run (fewer rows) may differ
        agrees = "" if args.quick or const is None else "  agrees" if abs(pooled - const) < 0.005 else "  DIFFERS"
        print(
            f"{'':17s} {'the class: mean over its sources':54s} {100 * pooled:15.1f}% "
            f"{'-' if const is None else f'{100 * const:.1f}%':>16s}{agrees}"
        )
    print(f"unvalidated classes: the largest of the constants, {100 * UNVALIDATED_TIME_ERROR:.1f}%")
    mit = smit.time_rows(args.quick)
    agrees = (
        ""
        if args.quick
        else "  agrees"
        if abs(mean_abs(e for _, e, _ in mit) - NETWORK_ERROR_SLOW) < 0.005
        else "  DIFFERS"
    )
    print(
        f"network at {NETWORK_SLOW_GBps:g} GB/s: Sailor's MIT runs (end to end) {len(mit):3d} "
        f"{100 * mean_abs(e for _, e, _ in mit):15.1f}% {100 * NETWORK_ERROR_SLOW:15.1f}%{agrees}"
    )
    print("\ncoverage of the bars (end-to-end runs): |time error| <= the prediction's expected_error")
    sources = {
        "Megatron-LM (A100 bf16/fp16)": meg,
        "Megatron-LM README 2020 (V100, A100)": readme["V100"] + readme["A100"],
        "Sailor GH200 OPT-350M (fitted)": sailor_section(sailor, "sailor_gh200"),
        "Sailor GH200 GPT-Neo-2.7B": neo,
        "Sailor MIT 1 Gbit/s (network bar)": mit,
        "ZeRO-Offload V100": v100,
        "RoundPipe RTX-4090 (fp16 accumulation)": rpipe,
        "torchtitan FSDP2 (held out)": tt.time_rows(),
        "autotune runner, 1 x H200 (held out)": h200_runner,
        "roundpipe lib, 1 x H200 (held out)": h200_roundpipe,
    }
    covered_all = n_all = 0
    for name, rows in sources.items():
        if not rows:
            continue
        covered = sum(abs(e) <= b for _, e, b in rows)
        covered_all, n_all = covered_all + covered, n_all + len(rows)
        print(
            f"  {name:38s} n={len(rows):3d}  mean |err| {100 * mean_abs(e for _, e, _ in rows):6.1f}%  "
            f"mean bar {100 * statistics.mean(b for _, _, b in rows):6.1f}%  covered {covered}/{len(rows)}"
        )
    print(
        f"  {'all':38s} covered {covered_all}/{n_all} ({covered_all / max(n_all, 1):.0%}; ~58% for a mean-|error| bar)"
    )
    print("\nmemory on the H200 (held out; autotune's runner, datasheet): simulated / measured - 1")
    for name, alloc, device in h200_memory:
        print(f"  {name:38s} allocator {alloc:+7.1%}  device {device:+7.1%}")
    print(
        f"  {'mean |error|':38s} allocator {mean_abs(a for _, a, _ in h200_memory):7.1%}  "
        f"device {mean_abs(d for _, _, d in h200_memory):7.1%}"
    )


if __name__ == "__main__":
    main()
