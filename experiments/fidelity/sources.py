"""The simulator's validation table by source: what was fitted to each, and how far off it is on each.

One row per source of measured runs in this repository (the scripts beside this one hold each source's own
table, run by run): how many runs, the mean, signed mean and largest |error| of the iteration time
(simulated / measured - 1; negative: the simulator is optimistic), the mean |error| of peak memory where the
source measured it, and the source's own simulator's mean |error| where it published one. "fitted" says
which of the simulator's constants came from that source; a source with "nothing" is a check nothing was
tuned on. Then issue 24's targets over the sources nothing was fitted to.

Not here: this machine's CPU runs (``fidelity.py``: real profiled runs, minutes; the simulator is calibrated
from their profile) and the ZeRO-Offload model-size rows (``zero_offload.py``).

    .venv/bin/python experiments/fidelity/sources.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import error_bars as eb  # noqa: E402
import sailor_mit as smit  # noqa: E402
import torchtitan_published as tt  # noqa: E402
import zero_offload as zo  # noqa: E402

from autotune.simulator.zero import model_state_bytes  # noqa: E402


@dataclass(frozen=True)
class Source:
    name: str
    setting: str
    fitted: str
    time_errors: list[float] = field(default_factory=list)
    memory_errors: list[float] = field(default_factory=list)
    own_simulator: str = "-"

    @property
    def held_out(self) -> bool:
        """Nothing of the simulator was fitted to this source."""
        return self.fitted.startswith("nothing")


def zero_table_errors() -> list[float]:
    """ZeRO's Table 1 (model-state GB per device): simulated / published - 1 per cell."""
    out = []
    for dp, rows in zo.ZERO_TABLE_1.items():
        for psi, published in zip(zo.SIZES, rows):
            for zero, pub in zip((1, 2, 3), published):
                out.append(model_state_bytes(psi, dp, zero) / 1e9 / pub - 1)
    return out


def sources(quick: bool) -> list[Source]:
    sailor = eb.sailor_runs()
    opt = [r for r in sailor if r["section"] == "sailor_gh200"]
    neo = [r for r in sailor if r["section"] == "sailor_gh200_gptneo"]
    readme = eb.megatron_readme(quick)
    layers = eb.sailor_layers()
    titan = tt.results()
    runner, rpipe, memory = eb.h200_runs()
    mit = [(r, m) for r, m in smit.results(quick) if m.ok]

    def sailor_own(rows: list[dict]) -> str:
        t = statistics.mean(abs(r["sailor_time_error"]) for r in rows)
        m = statistics.mean(abs(r["sailor_memory_error"]) for r in rows)
        return f"Sailor: time {t:.1%}, memory {m:.1%}"

    return [
        Source(
            "Megatron-LM papers (Narayanan 2021, Korthikanti 2022)",
            "A100-80GB x 8-3072, Megatron-LM",
            "nothing",
            [e for _, e, _ in eb.megatron(quick)],
        ),
        Source(
            "Megatron-LM README 2020",
            "V100-32GB x 1-8, A100-40GB x 1-1024, Megatron-LM",
            "nothing",
            [e for rows in readme.values() for _, e, _ in rows],
        ),
        Source(
            "Sailor GH200, OPT-350M",
            "GH200 x 1-32, Megatron-DeepSpeed fp32",
            "GH200 memory context, fp32 backward ratio",
            [r["time_error"] for r in opt],
            [r["memory_error"] for r in opt],
            sailor_own(opt),
        ),
        Source(
            "Sailor GH200, GPT-Neo-2.7B",
            "GH200 x 2-64, Megatron-DeepSpeed fp32",
            "nothing (held out of both GH200 fits)",
            [r["time_error"] for r in neo],
            [r["memory_error"] for r in neo],
            sailor_own(neo),
        ),
        Source(
            "Sailor MIT, consumer GPUs over 1 Gbit/s",
            "RTX-3090, TITAN RTX, RTX-2080 x 4-48, Aceso (Megatron-LM) fp32",
            "nothing of the model (it sets the network bar at 1 Gbit/s)",
            [
                m.iteration_time_s / r["measured"]["iteration_time_s"] - 1
                for r, m in mit
                if r["id"] not in smit.DUPLICATES
            ],
            [
                max(m.peak_memory_GiB.values()) / r["measured"]["peak_memory_GiB"] - 1
                for r, m in mit
                if r["id"] not in smit.DUPLICATES
            ],
        ),
        Source(
            "Sailor A100 / V100 block times",
            "A100-40GB, V100-16GB, one block, fp32",
            "nothing",
            [e for errs in layers.values() for e in errs],
        ),
        Source(
            "ZeRO (Rajbhandari et al. 2020) Table 1",
            "model states per device, 7.5B-1T, dp 1-1024",
            "nothing",
            memory_errors=zero_table_errors(),
        ),
        Source(
            "ZeRO-Offload, PyTorch 1.4B baseline",
            "V100-32GB x 1, PyTorch",
            "nothing",
            [e for _, e, _ in eb.v100_16bit()],
        ),
        Source(
            "RoundPipe README (seq 2k / 4k / 8k)",
            "RTX-4090 x 1-8, roundpipe, fp16 accumulation",
            "nothing",
            [e for _, e, _ in eb.roundpipe(quick)],
        ),
        Source(
            "torchtitan docs/performance.md",
            "A100-80GB x 64, H100 x 8-128, FSDP2",
            "nothing (its memory is why the loss's 12 B/logit was looked for)",
            [r["time_error"] for r in titan if r["time_error"] is not None],
            [r["memory_error"] for r in titan if r["memory_error"] is not None],
        ),
        Source(
            "autotune runner on one H200 (our GPU check)",
            "H200 x 1, autotune runner, eager",
            "nothing",
            [e for _, e, _ in runner],
            [a for _, a, _ in memory],
        ),
        Source(
            "roundpipe library on one H200 (our GPU check)",
            "H200 x 1, roundpipe 0.1.1",
            "nothing",
            [e for _, e, _ in rpipe],
        ),
    ]


def fmt(errors: list[float]) -> str:
    if not errors:
        return f"{'-':>7s} {'-':>7s} {'-':>7s}"
    mean = statistics.mean(abs(e) for e in errors)
    return f"{mean:7.1%} {statistics.mean(errors):+7.1%} {max(abs(e) for e in errors):7.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rows of the larger sources")
    args = ap.parse_args()
    table = sources(args.quick)
    print(
        f"{'source':52s} {'n':>3s} | {'time':>7s} {'signed':>7s} {'max':>7s} | {'n':>3s} {'memory':>7s} | fitted to it; "
        "setting; the source's own simulator"
    )
    for s in table:
        mem = (
            f"{len(s.memory_errors):3d} {statistics.mean(abs(e) for e in s.memory_errors):7.1%}"
            if s.memory_errors
            else f"{'-':>3s} {'-':>7s}"
        )
        print(
            f"{s.name:52s} {len(s.time_errors) or '-':>3} | {fmt(s.time_errors)} | {mem} | {s.fitted}; {s.setting}"
            + (f"; {s.own_simulator}" if s.own_simulator != "-" else "")
        )
    held = [s for s in table if s.held_out]
    timed = [s for s in held if s.time_errors]
    met = [s for s in timed if statistics.mean(abs(e) for e in s.time_errors) <= 0.15]
    over = [s.name for s in timed if statistics.mean(abs(e) for e in s.time_errors) > 0.25]
    mem = [s for s in held if s.memory_errors]
    mem_met = [s for s in mem if statistics.mean(abs(e) for e in s.memory_errors) <= 0.10]
    print(
        f"\nsources nothing was fitted to: time mean |error| <= 15% on {len(met)} of {len(timed)}; "
        f"memory <= 10% on {len(mem_met)} of {len(mem)}; over 25%: {', '.join(over) or 'none'}"
    )


if __name__ == "__main__":
    main()
