"""What ``autotune profile`` measures for a cluster and a model, and how it becomes a profile.

``plan_profile`` decides the work: one entry per distinct device type (a type that cannot be run here,
e.g. a GPU type without CUDA, is kept with the reason it is skipped) and one per link kind. Each item
is a small callable (``profile_steps``), so the CLI can show progress between items; ``to_profile``
puts the results in the ``CalibrationProfile`` format.

``cpu`` device types run on this host's cores. A GPU type runs when a CUDA device is here: it is
benchmarked on ``cuda:0`` (taken to be that type; the profile's ``notes`` name the device found) by
``autotune.calibration.gpu_bench``: matmuls, copy bandwidth, the runner's block per micro-batch size
(tensor-parallel degree 1: one device), with and without (full and selective) recomputation, embedding
and head, AdamW, and the device memory outside the allocator; links between GPUs are not measured.
CPU links (``intra_node`` and ``network``) are both two gloo processes on this one host: the same
physical path, measured once and recorded for both kinds (the profile's ``notes`` say so).
"""

from __future__ import annotations

import datetime as _dt
import logging
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from autotune.calibration import bench
from autotune.calibration.runtime_probe import (
    RuntimeOverheads,
    probe_model_memory,
    probe_parallel_overheads,
    probe_runtime,
)
from autotune.specs import ClusterSpec, ModelSpec

log = logging.getLogger(__name__)

LINK_KINDS = ("intra_node", "network")
PIPELINE_PROBE_MAX_RANKS = 4  # pipelines / replicas of up to this many ranks are probed; past that, extrapolated


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
    """Can this device type be benchmarked here? ``cpu`` always; a GPU type needs a CUDA device (the
    first one is benchmarked as that type)."""
    if device_name == "cpu":
        return True, ""
    try:
        import torch

        if torch.cuda.is_available():
            return True, ""
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
            tps = tuple(
                t
                for t in range(1, max_count + 1)
                if model.num_heads % t == 0 and model.num_kv_heads % t == 0 and model.ffn_hidden_size % t == 0
            )
        devices.append(DeviceTypePlan(name, ok, reason, mbs, tps))
    kinds = tuple(k for k in LINK_KINDS if k == "intra_node" or len(cluster.nodes) > 1) if cluster else LINK_KINDS
    any_cpu = any(n.device.name == "cpu" for n in cluster.nodes)
    gpu_nodes = [n.name for n in cluster.nodes if n.device.name != "cpu"]
    reason = (
        f"skipped for node(s) {', '.join(gpu_nodes)}: links between GPUs need CUDA devices here" if gpu_nodes else ""
    )
    return ProfilePlan(tuple(devices), kinds, any_cpu, reason)


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
    runtime: RuntimeOverheads | None = None
    model_memory: list[tuple[int, float]] = field(default_factory=list)  # (mbs, peak GiB, one rank holds all)
    contention: tuple[tuple[int, float], ...] = ()
    pipeline_overhead: tuple[tuple[int, float], ...] = ()
    data_parallel_overhead: tuple[tuple[int, float], ...] = ()
    tensor_parallel_overhead: tuple[tuple[int, float], ...] = ()
    gpu_memory_baseline_GiB: float | None = None  # CUDA: device memory outside the allocator's pool
    gpu_name: str = ""  # CUDA: the device that was benchmarked
    skipped: str = ""


@dataclass(frozen=True, slots=True)
class Step:
    """One unit of profiling work, with a label for the progress display."""

    label: str
    run: Callable[[], None]


def model_gemm_shapes(
    model: ModelSpec, micro_batch_sizes: tuple[int, ...], tp_degrees: tuple[int, ...]
) -> list[tuple[int, int, int]]:
    """The distinct (m, k, n) GEMMs a rank runs in a block's forward: QKV, output and MLP projections."""
    h, f, kv = model.hidden_size, model.ffn_hidden_size, model.kv_hidden_size
    shapes: set[tuple[int, int, int]] = set()
    for b in micro_batch_sizes:
        m = b * model.seq_len
        for t in tp_degrees:
            shapes |= {(m, h, (h + 2 * kv) // t), (m, h // t, h), (m, h, f // t), (m, f // t, h)}
    return sorted(shapes)


GENERIC_MATMUL_SHAPES = [(n, n, n) for n in (32, 64, 128, 256, 512, 1024)]
SMALL_MATMUL_SHAPES = [(n, n, n) for n in (32, 64, 128)]  # the small end (attention matmuls, tiny models)


def profile_steps(
    cluster: ClusterSpec,
    model: ModelSpec | None,
    plan: ProfilePlan,
    results: dict[str, DeviceResults],
    links: dict[str, bench.LinkBench],
    quick: bool = False,
) -> list[Step]:
    """The work list; each step fills ``results`` / ``links`` in place."""
    steps: list[Step] = []
    repeats = 3 if quick else 9
    for dev in plan.devices:
        res = results.setdefault(dev.name, DeviceResults(dev.name))
        if not dev.runnable:
            res.skipped = dev.skip_reason
            continue
        if dev.name != "cpu":
            steps += _gpu_steps(model, dev, res, quick)
            continue
        steps += _cpu_compute_steps(model, dev, res, repeats)
        steps += _cpu_runtime_steps(cluster, model, dev, res, quick)
    if plan.links_runnable:

        def link_bench():
            measured = bench.bench_links(repeats=6 if quick else 12)
            for kind in plan.link_kinds:
                links[kind] = measured

        steps.append(Step(f"links ({', '.join(plan.link_kinds)}): gloo p2p + all-reduce, 2 processes", link_bench))
    return steps


def _cpu_compute_steps(model: ModelSpec | None, dev: DeviceTypePlan, res: DeviceResults, repeats: int) -> list[Step]:
    """The compute micro-benchmarks of a CPU device type: matmuls, memory bandwidth, and with a model its
    blocks, embedding and head, and the optimizer step."""
    steps: list[Step] = []
    shapes = (
        SMALL_MATMUL_SHAPES + model_gemm_shapes(model, dev.micro_batch_sizes, dev.tp_degrees)
        if model
        else GENERIC_MATMUL_SHAPES
    )

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
                    res.layers.append(bench.bench_layer(shape, b, t, recompute=True, repeats=repeats))

                steps.append(Step(f"{dev.name}: layer fwd/bwd mbs={b} tp={t}", layer))

            def edges(res=res, b=b):
                res.edges.append(
                    bench.bench_edges(model.hidden_size, model.vocab_size, model.seq_len, b, repeats=repeats)
                )

            steps.append(Step(f"{dev.name}: embedding + head mbs={b}", edges))

        def optimizer(res=res):
            res.optimizer_s_per_param = bench.bench_optimizer(repeats=repeats)

        steps.append(Step(f"{dev.name}: optimizer step", optimizer))
    return steps


def _cpu_runtime_steps(
    cluster: ClusterSpec, model: ModelSpec | None, dev: DeviceTypePlan, res: DeviceResults, quick: bool
) -> list[Step]:
    """The runner's measured overheads on the ``cpu`` device (gloo ranks on this machine): its runtime per
    step, memory, host contention, pipeline hand-offs, data- and tensor-parallel steps."""
    steps: list[Step] = []
    if dev.name != "cpu":
        return steps

    def runtime(res=res):
        res.runtime = probe_runtime(repeats=8 if quick else 20)

    ranks_here = sum(n.count for n in cluster.nodes if n.device.name == dev.name)

    def contention(res=res, n=ranks_here):
        res.contention = bench.bench_contention(
            max(2, min(n, 8)), duration_s=0.25 if quick else 0.4, rounds=1 if quick else 3
        )

    steps.append(Step(f"{dev.name}: runner overheads (one gloo rank, pipelining engine)", runtime))
    if model is not None:
        sizes = dev.micro_batch_sizes
        for b in sorted({sizes[0], sizes[min(2, len(sizes) - 1)]}):  # e.g. mbs 1 and 4

            def model_memory(res=res, b=b):
                res.model_memory.append((b, probe_model_memory(model, b)))

            steps.append(Step(f"{dev.name}: runner memory, whole model on one rank, mbs={b}", model_memory))
    steps.append(Step(f"{dev.name}: host contention, 1..{max(2, min(ranks_here, 8))} processes", contention))
    pipe_ranks = max(2, min(ranks_here, PIPELINE_PROBE_MAX_RANKS))

    def parallel(res=res, n=pipe_ranks):
        measured = probe_parallel_overheads(n, rounds=1 if quick else 2)
        res.pipeline_overhead = measured.pipeline
        res.data_parallel_overhead = measured.data_parallel
        res.tensor_parallel_overhead = measured.tensor_parallel

    steps.append(
        Step(
            f"{dev.name}: pipeline hand-offs, data-parallel steps, tensor-parallel layers, 1..{pipe_ranks} ranks",
            parallel,
        )
    )
    return steps


def _gpu_steps(model: ModelSpec | None, dev: DeviceTypePlan, res: DeviceResults, quick: bool) -> list[Step]:
    """The work on ``cuda:0`` for GPU type ``dev`` (``autotune.calibration.gpu_bench``): one device, so
    tensor-parallel degree 1 only."""
    from autotune.calibration import gpu_bench

    repeats = 5 if quick else 10
    precision = model.precision if model is not None else "bf16"
    shapes = (
        model_gemm_shapes(model, dev.micro_batch_sizes, (1,))
        if model is not None
        else [(n, n, n) for n in (256, 512, 1024, 2048, 4096, 8192)]
    )
    steps = []

    def identify(res=res):
        import torch

        res.gpu_name = torch.cuda.get_device_name(0)
        res.gpu_memory_baseline_GiB = gpu_bench.cuda_memory_baseline()

    def matmul(res=res, shapes=shapes):
        res.matmul.extend(gpu_bench.cuda_matmul(shapes, precision, repeats=repeats))

    def membw(res=res):
        res.memory_bandwidth_GBps = gpu_bench.cuda_memory_bandwidth(repeats=repeats)

    steps += [
        Step(f"{dev.name}: CUDA device and its memory outside the allocator", identify),
        Step(f"{dev.name}: matmul at {len(shapes)} shapes ({precision})", matmul),
        Step(f"{dev.name}: memory bandwidth", membw),
    ]
    if model is not None:
        for b in dev.micro_batch_sizes:

            def layer(res=res, b=b):
                for rc in (False, True, "selective"):
                    res.layers.append(gpu_bench.cuda_layer(model, b, rc, repeats=repeats))

            def edges(res=res, b=b):
                res.edges.append(gpu_bench.cuda_edges(model, b, repeats=repeats))

            steps += [
                Step(f"{dev.name}: runner block fwd/bwd mbs={b} (recompute none, full, selective)", layer),
                Step(f"{dev.name}: embedding + head mbs={b}", edges),
            ]

        def optimizer(res=res):
            res.optimizer_s_per_param = gpu_bench.cuda_optimizer()

        steps.append(Step(f"{dev.name}: optimizer step", optimizer))
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


def matmul_curve(points: list[bench.MatmulPoint]) -> tuple[tuple[float, float], ...]:
    """``(n, tflops)`` pairs with ``n`` the cube root of ``m * k * n`` (the profile's index); shapes that
    land on the same ``n`` (to 0.1) are averaged."""
    by_n: dict[float, list[float]] = {}
    for p in points:
        n = round(float(p.m * p.k * p.n) ** (1.0 / 3.0), 1)
        by_n.setdefault(n, []).append(p.tflops)
    return tuple(sorted((n, sum(v) / len(v)) for n, v in by_n.items()))


def fit_memory_terms(model: ModelSpec, device, probes: list[tuple[int, float]]) -> tuple[float, float]:
    """``(state_bytes_per_param, activation_memory_factor)`` from one-rank whole-model runs: solve
    ``peak - baseline = s * params + a * activations`` (activations as the simulator counts them for
    that run: one micro-batch in flight, measured per-layer bytes). One probe: ``a = 1``."""
    import numpy as np

    from autotune.simulator.memory import GiB, stage_activation_bytes, stage_params

    params = stage_params(model, model.num_layers, 1, True, True)
    rows, rhs = [], []
    for mbs, peak_GiB in probes:
        full = device.layer_timing(model, mbs, 1)
        acts = stage_activation_bytes(
            model,
            mbs,
            1,
            model.num_layers,
            False,
            1,
            1,
            True,
            True,
            measured_full_bytes=full.activation_bytes if full else None,
            elem_bytes=4,
        )  # the CPU runner computes in fp32
        rows.append((params, acts))
        rhs.append((peak_GiB - (device.memory_baseline_GiB or 0.0)) * GiB)
    if len(rows) >= 2 and len({r[1] for r in rows}) > 1:
        (s, a), *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(rhs), rcond=None)
        if a >= 1.0 and s >= 4.0:
            return float(s), float(a)
    # one probe, or a fit outside the physical range: every saved byte counts once
    s = statistics.mean((y - acts) / p for (p, acts), y in zip(rows, rhs))
    return max(4.0, float(s)), 1.0


def _timings(model: ModelSpec | None, name: str, res: DeviceResults) -> tuple[tuple, tuple]:
    """(layer timings, embedding + head timings) of device type ``name`` in the profile format."""
    from autotune.profile import EdgeTiming, LayerTiming

    layers, edges = [], []
    if model is not None:
        for t in res.layers:
            gpu = name != "cpu"  # measured in the model's precision and attention: match only those
            layers.append(
                LayerTiming(
                    hidden_size=model.hidden_size,
                    num_heads=model.num_heads,
                    num_kv_heads=model.num_kv_heads,
                    ffn_hidden_size=model.ffn_hidden_size,
                    mlp=model.mlp,
                    seq_len=model.seq_len,
                    micro_batch_size=t.micro_batch_size,
                    tp=t.tp,
                    recompute=t.recompute,
                    forward_s=max(t.forward_s, 1e-9),
                    backward_s=max(t.backward_s, 1e-9),
                    activation_bytes=float(t.activation_bytes),
                    precision=model.precision if gpu else None,
                    attention=model.attention if gpu else None,
                )
            )
        for e in res.edges:
            # the runner holds the embedding and the head whole on one rank (tp 1); with tp > 1 the
            # simulator would fall back to its model for these
            edges.append(
                EdgeTiming(
                    hidden_size=model.hidden_size,
                    vocab_size=model.vocab_size,
                    seq_len=model.seq_len,
                    micro_batch_size=e.micro_batch_size,
                    tp=1,
                    embedding_forward_s=e.embedding_forward_s,
                    embedding_backward_s=e.embedding_backward_s,
                    head_forward_s=e.head_forward_s,
                    head_backward_s=e.head_backward_s,
                )
            )
    return tuple(layers), tuple(edges)


def to_profile(
    cluster: ClusterSpec,
    model: ModelSpec | None,
    plan: ProfilePlan,
    results: dict[str, DeviceResults],
    links: dict[str, bench.LinkBench],
):
    """Put raw results in the ``CalibrationProfile`` format (``autotune/profile.py``)."""
    from autotune.profile import CalibrationProfile, DeviceProfile, NodeLinks
    from autotune.specs import LinkSpec

    devices = []
    for name, res in results.items():
        if res.skipped or not res.matmul:
            continue
        layers, edges = _timings(model, name, res)
        rt = res.runtime
        dev = DeviceProfile(
            name,
            matmul_curve(res.matmul),
            res.memory_bandwidth_GBps or None,
            tuple(layers),
            tuple(edges),
            res.optimizer_s_per_param or None,
            microbatch_overhead_s=rt.microbatch_overhead_s if rt else None,
            memory_baseline_GiB=rt.memory_baseline_GiB if rt else res.gpu_memory_baseline_GiB,
            contention=tuple((float(n), float(k)) for n, k in res.contention),
            pipeline_overhead=tuple((float(n), float(t)) for n, t in res.pipeline_overhead),
            data_parallel_overhead=tuple((float(n), float(t)) for n, t in res.data_parallel_overhead),
            tensor_parallel_overhead=tuple((float(n), float(t)) for n, t in res.tensor_parallel_overhead),
        )
        if res.model_memory and model is not None and rt is not None:
            s, a = fit_memory_terms(model, dev, res.model_memory)
            dev = replace(dev, state_bytes_per_param=s, activation_memory_factor=a)
        devices.append(dev)
    node_links = []
    if links:
        for node in cluster.nodes:
            if node.device.name != "cpu":  # measured between CPU ranks; says nothing about GPU links
                continue
            kinds = {}
            for kind in ("intra_node", "network"):
                lb = links.get(kind) or links.get("intra_node")
                if lb is not None:
                    kinds[kind] = LinkSpec(lb.p2p.bandwidth_GBps, lb.p2p.latency_us)
            node_links.append(NodeLinks(node.name, **kinds))
    env = environment_notes()
    versions = (
        ("torch", env["torch_version"]),
        ("python", env["python_version"]),
        ("host", env["host"]),
        ("cpu", env["cpu"]),
    )
    notes = [f"{name}: {res.skipped}" for name, res in results.items() if res.skipped]
    notes += [
        f"{name}: benchmarked on CUDA device {res.gpu_name!r} (cuda:0), tensor-parallel degree 1"
        for name, res in results.items()
        if res.gpu_name
    ]
    if links:
        notes.append(
            "links of cpu nodes: intra_node and network are both two gloo processes on this one host (the same "
            "physical path), measured once by p2p ping-pong and recorded for both kinds; all-reduce "
            f"measured {links['intra_node'].allreduce.bandwidth_GBps:.2f} GB/s + "
            f"{links['intra_node'].allreduce.latency_us:.0f} us between 2 ranks"
        )
    if plan.links_skip_reason:
        notes.append(f"links: {plan.links_skip_reason}")
    step_overhead = max((r.runtime.step_overhead_s for r in results.values() if r.runtime), default=0.0)
    return CalibrationProfile(
        devices=tuple(devices),
        links=tuple(node_links),
        created=env["date"],
        cluster=cluster.name,
        versions=versions,
        step_overhead_s=step_overhead,
        notes="; ".join(notes),
    )
