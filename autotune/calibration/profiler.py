"""What ``autotune profile`` measures for a cluster and a model, and how it becomes a profile.

``plan_profile`` decides the work: one entry per distinct device type (a type that cannot be run here,
e.g. a GPU type without CUDA, is kept with the reason it is skipped) and one per link kind. Each item
is a small callable, so the CLI can show progress between items; ``run_profile`` runs them all and
returns a ``CalibrationProfile``.

On this machine only ``cpu`` device types run. Their links (``intra_node`` and ``network``) are both
two gloo processes on this one host: the same physical path, measured once and recorded for both
kinds (the profile's ``notes`` say so).
"""

from __future__ import annotations

import datetime as _dt
import logging
import platform
from dataclasses import dataclass, field
from typing import Callable

from autotune.calibration import bench
from autotune.specs import ClusterSpec, ModelSpec

log = logging.getLogger(__name__)

LINK_KINDS = ("intra_node", "network")


def _powers_of_two_upto(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


@dataclass(frozen=True, slots=True)
class DeviceTypePlan:
    name: str
    runnable: bool
    skip_reason: str = ""
    micro_batch_sizes: tuple[int, ...] = ()
    tp_degrees: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ProfilePlan:
    devices: tuple[DeviceTypePlan, ...]
    link_kinds: tuple[str, ...]
    links_runnable: bool
    links_skip_reason: str = ""


def device_runnable(device_name: str) -> tuple[bool, str]:
    """Can this device type be benchmarked here? ``cpu`` always; a GPU type needs a CUDA device."""
    if device_name == "cpu":
        return True, ""
    try:
        import torch

        if torch.cuda.is_available():
            return False, f"CUDA device here is {torch.cuda.get_device_name(0)!r}; GPU profiling is not implemented"
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return False, "skipped: no CUDA device here"


def plan_profile(cluster: ClusterSpec, model: ModelSpec | None, max_micro_batch_size: int = 8) -> ProfilePlan:
    by_type: dict[str, int] = {}
    for node in cluster.nodes:
        by_type[node.device.name] = max(by_type.get(node.device.name, 0), node.count)
    devices = []
    for name, max_count in by_type.items():
        ok, reason = device_runnable(name)
        mbs: tuple[int, ...] = ()
        tps: tuple[int, ...] = ()
        if model is not None:
            mbs = tuple(_powers_of_two_upto(min(model.global_batch_size, max_micro_batch_size)))
            tps = tuple(t for t in range(1, max_count + 1) if model.num_heads % t == 0
                        and model.num_kv_heads % t == 0 and model.ffn_hidden_size % t == 0)
        devices.append(DeviceTypePlan(name, ok, reason, mbs, tps))
    kinds = tuple(k for k in LINK_KINDS if k == "intra_node" or len(cluster.nodes) > 1) if cluster else LINK_KINDS
    all_cpu = all(n.device.name == "cpu" for n in cluster.nodes)
    reason = "" if all_cpu else "skipped: links between GPUs need CUDA devices here"
    return ProfilePlan(tuple(devices), kinds, all_cpu, reason)


# --------------------------------------------------------------------------------------------------
# Raw results, before they are put in the profile format


@dataclass
class DeviceResults:
    name: str
    matmul: list[bench.MatmulPoint] = field(default_factory=list)
    memory_bandwidth_GBps: float = 0.0
    layers: list[bench.LayerTiming] = field(default_factory=list)
    edges: list[bench.EdgeTiming] = field(default_factory=list)
    optimizer_s_per_param: float = 0.0
    skipped: str = ""


@dataclass(frozen=True, slots=True)
class Step:
    """One unit of profiling work, with a label for the progress display."""

    label: str
    run: Callable[[], None]


def model_gemm_shapes(model: ModelSpec, micro_batch_sizes: tuple[int, ...], tp_degrees: tuple[int, ...]
                      ) -> list[tuple[int, int, int]]:
    """The distinct (m, k, n) GEMMs a rank runs in a block's forward: QKV, output and MLP projections."""
    h, f, kv = model.hidden_size, model.ffn_hidden_size, model.kv_hidden_size
    shapes: set[tuple[int, int, int]] = set()
    for b in micro_batch_sizes:
        m = b * model.seq_len
        for t in tp_degrees:
            shapes |= {(m, h, (h + 2 * kv) // t), (m, h // t, h), (m, h, f // t), (m, f // t, h)}
    return sorted(shapes)


GENERIC_MATMUL_SHAPES = [(n, n, n) for n in (128, 256, 512, 1024)]


def profile_steps(cluster: ClusterSpec, model: ModelSpec | None, plan: ProfilePlan,
                  results: dict[str, DeviceResults], links: dict[str, bench.LinkBench],
                  quick: bool = False) -> list[Step]:
    """The work list; each step fills ``results`` / ``links`` in place."""
    steps: list[Step] = []
    repeats = 3 if quick else 5
    for dev in plan.devices:
        res = results.setdefault(dev.name, DeviceResults(dev.name))
        if not dev.runnable:
            res.skipped = dev.skip_reason
            continue
        shapes = (model_gemm_shapes(model, dev.micro_batch_sizes, dev.tp_degrees) if model else GENERIC_MATMUL_SHAPES)

        def matmul(res=res, shapes=shapes):
            res.matmul.extend(bench.bench_matmul(shapes, repeats=repeats))

        def membw(res=res):
            res.memory_bandwidth_GBps = bench.bench_memory_bandwidth(repeats=repeats)

        steps.append(Step(f"{dev.name}: matmul at {len(shapes)} shapes", matmul))
        steps.append(Step(f"{dev.name}: memory bandwidth", membw))
        if model is not None:
            shape = bench.LayerShape.of(model)
            for b in dev.micro_batch_sizes:
                for t in dev.tp_degrees:
                    def layer(res=res, b=b, t=t):
                        res.layers.append(bench.bench_layer(shape, b, t, repeats=repeats))

                    steps.append(Step(f"{dev.name}: layer fwd/bwd mbs={b} tp={t}", layer))

                def edges(res=res, b=b):
                    res.edges.append(bench.bench_edges(model.hidden_size, model.vocab_size, model.seq_len, b,
                                                       repeats=repeats))

                steps.append(Step(f"{dev.name}: embedding + head mbs={b}", edges))

            def optimizer(res=res):
                res.optimizer_s_per_param = bench.bench_optimizer(repeats=repeats)

            steps.append(Step(f"{dev.name}: optimizer step", optimizer))
    if plan.links_runnable:
        def link_bench():
            measured = bench.bench_links(repeats=6 if quick else 12)
            for kind in plan.link_kinds:
                links[kind] = measured

        steps.append(Step(f"links ({', '.join(plan.link_kinds)}): gloo p2p + all-reduce, 2 processes", link_bench))
    return steps


def environment_notes() -> dict[str, str]:
    import torch

    return {
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
