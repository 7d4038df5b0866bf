"""Calibration profiles: measured device and link speeds that replace the simulator's defaults.

``autotune profile`` measures a cluster and writes one of these; ``autotune simulate --profile P``
and ``Simulator(..., profile=...)`` read it. The file is JSON::

    {
      "format_version": 1,
      "created": "2026-11-29T15:00:00+00:00",          # ISO-8601, when it was measured
      "cluster": "mixed-a100-v100",                      # the cluster it was measured on (informative)
      "versions": {"torch": "2.13.0", "cuda": "12.4"},   # software that measured it (informative)
      "devices": {
        "A100-80GB": {                                   # a DeviceSpec name, as in the cluster file
          "matmul_tflops": [[512, 110.0], [1024, 205.0], [4096, 265.0]],
          "memory_bandwidth_GBps": 1700.0,               # optional: measured copy bandwidth
          "layers": [                                    # optional: measured transformer layers
            {"hidden_size": 4096, "num_heads": 32, "num_kv_heads": 32, "ffn_hidden_size": 11008,
             "mlp": "swiglu", "seq_len": 4096, "micro_batch_size": 1, "tp": 1, "recompute": false,
             "forward_s": 0.0123, "backward_s": 0.0251}
          ],
          "edges": [                                     # optional: measured embedding and LM head + loss
            {"hidden_size": 4096, "vocab_size": 32000, "seq_len": 4096, "micro_batch_size": 1, "tp": 1,
             "embedding_forward_s": 0.0002, "embedding_backward_s": 0.0004,
             "head_forward_s": 0.004, "head_backward_s": 0.008}
          ],
          "optimizer_s_per_param": 2.0e-11              # optional: measured Adam step time per parameter
        }
      },
      "links": {                                         # optional, per node of the cluster file
        "a100": {"intra_node": {"bandwidth_GBps": 240.0, "latency_us": 3.0},
                 "network": {"bandwidth_GBps": 11.0, "latency_us": 12.0}}
      },
      "step_overhead_s": 0.0,                            # optional: fixed time added to every iteration
      "notes": "free text: how it was measured, what was skipped"
    }

- ``matmul_tflops``: sustained TFLOP/s of an ``n x n x n`` matrix multiply, as ``[n, tflops]``
  pairs, at the precision the device was profiled in. For other shapes the simulator uses the cube root
  of ``M * N * K`` as ``n`` and interpolates linearly in ``log n`` between measured sizes, clamping
  outside the measured range. Required unless ``layers`` is given: a device profiled only by its
  layer times (for example times measured by another tool, see below) uses the datasheet curve
  for whatever its entries do not cover.
- ``layers``: per-transformer-layer times for one micro-batch of ``micro_batch_size`` sequences on a
  tensor-parallel group of ``tp`` such devices, tensor-parallel communication included; with
  ``"recompute": true`` the backward includes the recomputed forward, with ``"selective"`` the
  recomputed attention core, with ``"selective-op"`` the rerun non-matmul ops (default false). When a stage matches an entry exactly (shape,
  micro-batch, tp), the simulator uses it instead of the FLOP model; a recomputing stage without a
  ``recompute: true`` entry uses ``forward_s + backward_s`` as backward. An entry may also name the
  model ``precision`` and ``attention`` it was measured with; it then matches only models with
  those (absent: any). Measured times include every fixed cost (kernel launches, framework work), so
  the simulator adds no datasheet overhead to a layer it takes from the profile.
- ``source`` (per device, optional): free text saying who measured the device and how, e.g. per-layer
  times transcribed from another system's profiler (``experiments/fidelity/sailor_validation.py`` builds such a
  profile from Sailor's published per-layer times).
- ``matmul_roofline`` (per device, default false): ``true`` when ``matmul_tflops`` is the datasheet curve,
  not measured: each matmul then also takes at least its operands' memory traffic, as without a profile
  (a measured curve holds that already). A ``--backend real`` search without ``--profile`` writes such a
  curve, scaled by its runs, to ``calibrated_profile.json``.
- ``edges``: the same for the embedding (first stage) and the final norm + LM head + loss (last stage).
- ``optimizer_s_per_param``: the optimizer step's time per parameter a device holds.
- ``links``: measured one-direction bandwidth and latency, replacing the cluster file's numbers.

Runner overheads (optional, added by the calibration helper; ``autotune.calibration``):

- ``layers[].activation_bytes``: bytes autograd keeps for one layer's backward for one micro-batch
  (measured with saved-tensor hooks; with ``recompute: true`` only the checkpointed input). When the
  entries exist the memory model uses them instead of the 16-bit Korthikanti formula.
- ``microbatch_overhead_s``: the pipeline runtime's own time per micro-batch and stage (forward plus
  backward, half each), measured by running the runner's engine on a negligible model.
- ``memory_baseline_GiB``: what a rank's measured peak memory holds besides weights, optimizer state
  and activations (CPU runner: peak-RSS growth of process group, imported modules, allocator arenas).
- ``state_bytes_per_param``: measured memory per parameter a rank holds for weights, gradients and
  optimizer state, as the runtime really allocates them (CPU runner: fp32 AdamW plus what the allocator
  keeps between steps); replaces the 16-byte mixed-precision figure.
- ``activation_memory_factor``: measured peak memory per activation byte autograd keeps (backward
  temporaries and allocator retention make it > 1 on the CPU runner); multiplies the activations.
- ``contention``: ``[processes, stretch]`` pairs: wall time per second of compute (CPU time) when that
  many ranks of this type compute at once on one shared host (CPU ranks on one machine, whose cores
  other programs may also use: ``stretch(1) > 1``). The simulator's iteration is at least
  ``stretch(1)`` times its schedule, and at least the plan's compute work on that host times
  ``stretch(n) / n`` (``n`` ranks do ``n / stretch(n)`` ranks' worth of work per second; processor
  sharing is work-conserving), with ``n`` the plan's ranks of the type, each weighted ``1 / slowdown``
  (an emulated slow rank sleeps most of its time). Compute times in the profile are CPU times.
- ``pipeline_overhead``: ``[ranks, seconds]`` pairs: what each micro-batch costs each stage of a
  pipeline beyond ``microbatch_overhead_s`` when ``ranks`` runner ranks of this type share the host:
  the hand-offs between stages (send/recv, waking the next rank) and the ranks' runtime overheads
  competing for the cores, measured on a ``ranks``-stage pipeline of a negligible model. The
  simulator adds it (half to forward, half to backward) to every stage of a multi-stage pipeline, with
  ``ranks`` the plan's ranks of the type (interpolated; linear past the last point, 0 at one rank),
  and leaves it out of the compute work of the ``contention`` bound (it was measured under contention).
- ``data_parallel_overhead``: ``[ranks, seconds]`` pairs: what one training step of a plan with
  several data-parallel replicas costs beyond one rank's step when ``ranks`` runner ranks of this type
  share the host: the gradient all-reduce call and the wait for the slowest replica, measured on
  ``ranks`` one-stage replicas of a negligible model (step-time intercepts). The simulator adds it once
  per step, after the gradient all-reduce, to plans with more than one pipeline (same interpolation).
- ``tensor_parallel_overhead``: ``[tp, seconds]`` pairs: what each layer costs per micro-batch (forward
  plus backward) in a ``tp``-way tensor-parallel stage of the runner beyond the layer's math and the
  activation bytes: the per-layer collectives' fixed costs (CPU runner: DTensor dispatch and gloo calls),
  measured on a negligible model. The simulator adds it, half to forward and half to backward, per layer
  of every stage with ``tp`` > 1 (0 at tp 1, interpolated, proportional past the last point).

Every field is validated on load; a bad file raises one ``SpecError`` naming the file and field.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import SpecError, shown
from autotune.specs import ATTENTION_KINDS, MLP_KINDS, PRECISIONS, LinkSpec, ModelSpec

FORMAT_VERSION = 1


def _number(source: str, field: str, value: Any, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(source, field, f"must be a number, got {shown(value)}")
    if positive and value <= 0:
        raise SpecError(source, field, f"must be > 0, got {value}")
    if not positive and value < 0:
        raise SpecError(source, field, f"must be >= 0, got {value}")
    return float(value)


def _integer(source: str, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(source, field, f"must be an integer >= 1, got {shown(value)}")
    return value


@dataclass(frozen=True, slots=True)
class LayerTiming:
    """Measured forward and backward time of one transformer layer for one micro-batch."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    mlp: str
    seq_len: int
    micro_batch_size: int
    tp: int
    forward_s: float
    backward_s: float
    recompute: bool | str = False
    activation_bytes: float | None = None  # measured bytes kept for the backward (calibration; optional)
    precision: str | None = None  # the model precision it was measured with; None: matches any
    attention: str | None = None  # the attention kind it was measured with; None: matches any

    def key(self) -> tuple:
        return (
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.ffn_hidden_size,
            self.mlp,
            self.seq_len,
            self.micro_batch_size,
            self.tp,
            self.recompute,
        )

    def matches(self, model: ModelSpec) -> bool:
        """Whether the entry's precision / attention (when it names them) are the model's."""
        return (self.precision is None or self.precision == model.precision) and (
            self.attention is None or self.attention == model.attention
        )

    @staticmethod
    def key_for(model: ModelSpec, micro_batch_size: int, tp: int, recompute: bool | str = False) -> tuple:
        return (
            model.hidden_size,
            model.num_heads,
            model.num_kv_heads,
            model.ffn_hidden_size,
            model.mlp,
            model.seq_len,
            micro_batch_size,
            tp,
            recompute,
        )


_LAYER_FIELDS = (
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "mlp",
    "seq_len",
    "micro_batch_size",
    "tp",
    "recompute",
    "forward_s",
    "backward_s",
)


@dataclass(frozen=True, slots=True)
class EdgeTiming:
    """Measured embedding (first stage) and final norm + LM head + loss (last stage) times."""

    hidden_size: int
    vocab_size: int
    seq_len: int
    micro_batch_size: int
    tp: int
    embedding_forward_s: float
    embedding_backward_s: float
    head_forward_s: float
    head_backward_s: float

    def key(self) -> tuple:
        return (self.hidden_size, self.vocab_size, self.seq_len, self.micro_batch_size, self.tp)

    @staticmethod
    def key_for(model: ModelSpec, micro_batch_size: int, tp: int) -> tuple:
        return (model.hidden_size, model.vocab_size, model.seq_len, micro_batch_size, tp)


#: a device's measured curves: field -> what each ``[x, y]`` pair is (``contention``'s y must be > 0)
_CURVES = {
    "contention": "[processes, stretch]",
    "pipeline_overhead": "[ranks, seconds]",
    "data_parallel_overhead": "[ranks, seconds]",
    "tensor_parallel_overhead": "[tp, seconds]",
}

_EDGE_FIELDS = (
    "hidden_size",
    "vocab_size",
    "seq_len",
    "micro_batch_size",
    "tp",
    "embedding_forward_s",
    "embedding_backward_s",
    "head_forward_s",
    "head_backward_s",
)


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One device type's measurements. ``matmul`` holds ``(n, tflops)`` sorted by ``n``."""

    name: str
    matmul: tuple[tuple[float, float], ...]
    memory_bandwidth_GBps: float | None = None
    layers: tuple[LayerTiming, ...] = ()
    edges: tuple[EdgeTiming, ...] = ()
    optimizer_s_per_param: float | None = None
    # Calibration terms for runtimes whose costs are not the model's math (see "Runner overheads" in
    # the module docstring); all optional, written by ``autotune profile``.
    microbatch_overhead_s: float | None = None
    memory_baseline_GiB: float | None = None
    state_bytes_per_param: float | None = None  # measured weights + grads + optimizer state per parameter
    activation_memory_factor: float | None = None  # measured peak memory per byte autograd saves
    contention: tuple[tuple[float, float], ...] = ()  # (processes computing at once, time stretch)
    pipeline_overhead: tuple[tuple[float, float], ...] = ()  # (ranks on the host, s per micro-batch and stage)
    data_parallel_overhead: tuple[tuple[float, float], ...] = ()  # (ranks on the host, s per step)
    tensor_parallel_overhead: tuple[tuple[float, float], ...] = ()  # (tp, s per layer and micro-batch)
    source: str = ""  # who measured it and how (free text)
    matmul_roofline: bool = False  # ``matmul`` is the datasheet curve: bound each matmul by memory traffic too

    def __post_init__(self) -> None:
        if not self.matmul and not self.layers:
            raise SpecError(
                f"profile device {shown(self.name)}",
                "matmul_tflops",
                "must list at least one [n, tflops] (or give the device's measured layers)",
            )
        object.__setattr__(self, "matmul", tuple(sorted((float(n), float(t)) for n, t in self.matmul)))

    def matmul_tflops(self, n: float) -> float:
        """Sustained TFLOP/s for an ``n``-sized (cube-root of M*N*K) matmul: linear in log n, clamped.
        Only for a profile with ``matmul`` points (``DeviceRates`` uses the datasheet curve otherwise)."""
        if not self.matmul:
            raise ValueError(f"profile device {self.name!r} has no matmul_tflops")
        sizes = [s for s, _ in self.matmul]
        if n <= sizes[0]:
            return self.matmul[0][1]
        if n >= sizes[-1]:
            return self.matmul[-1][1]
        i = bisect.bisect_right(sizes, n)
        (n0, t0), (n1, t1) = self.matmul[i - 1], self.matmul[i]
        w = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
        return t0 + w * (t1 - t0)

    def layer_timing(
        self, model: ModelSpec, micro_batch_size: int, tp: int, recompute: bool = False
    ) -> LayerTiming | None:
        key = LayerTiming.key_for(model, micro_batch_size, tp, recompute)
        for layer in self.layers:
            if layer.key() == key and layer.matches(model):
                return layer
        return None

    def contention_stretch(self, processes: float) -> float:
        """How much longer compute takes when ``processes`` ranks of this type compute at once on a
        shared host: interpolated in ``contention``; past its end, processor sharing (linear in n)."""
        return max(1.0, _piecewise_linear(self.contention, processes)) if self.contention else 1.0

    def pipeline_overhead_s(self, ranks: float) -> float:
        """Seconds per micro-batch and stage that pipelining costs when ``ranks`` ranks of this type share
        the host (``pipeline_overhead``): 0 at one rank, interpolated from there through the measured
        points, linear in ``ranks`` past the last one."""
        return _rank_curve(self.pipeline_overhead, ranks)

    def data_parallel_overhead_s(self, ranks: float) -> float:
        """Seconds per step that data parallelism costs when ``ranks`` ranks of this type share the host
        (``data_parallel_overhead``; interpolated like ``pipeline_overhead_s``)."""
        return _rank_curve(self.data_parallel_overhead, ranks)

    def tensor_parallel_overhead_s(self, tp: float) -> float:
        """Seconds per layer and micro-batch that ``tp``-way tensor parallelism costs beyond the math and
        the bytes (``tensor_parallel_overhead``; interpolated like ``pipeline_overhead_s``)."""
        return _rank_curve(self.tensor_parallel_overhead, tp)

    def edge_timing(self, model: ModelSpec, micro_batch_size: int, tp: int) -> EdgeTiming | None:
        key = EdgeTiming.key_for(model, micro_batch_size, tp)
        for edge in self.edges:
            if edge.key() == key:
                return edge
        return None


@dataclass(frozen=True, slots=True)
class NodeLinks:
    """Measured links of one node of the cluster file (either may be absent)."""

    node: str
    intra_node: LinkSpec | None = None
    network: LinkSpec | None = None


@dataclass(frozen=True, slots=True)
class CalibrationProfile:
    devices: tuple[DeviceProfile, ...]
    links: tuple[NodeLinks, ...] = ()
    created: str = ""
    cluster: str = ""
    versions: tuple[tuple[str, str], ...] = ()
    step_overhead_s: float = 0.0
    notes: str = ""

    def device(self, name: str) -> DeviceProfile | None:
        for d in self.devices:
            if d.name == name:
                return d
        return None

    def node_links(self, node: str) -> NodeLinks | None:
        for link in self.links:
            if link.node == node:
                return link
        return None

    # -- (de)serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        devices: dict[str, Any] = {}
        for d in self.devices:
            entry: dict[str, Any] = {"matmul_tflops": [[n, t] for n, t in d.matmul]} if d.matmul else {}
            if d.source:
                entry["source"] = d.source
            if d.matmul_roofline:
                entry["matmul_roofline"] = True
            if d.memory_bandwidth_GBps is not None:
                entry["memory_bandwidth_GBps"] = d.memory_bandwidth_GBps
            if d.layers:
                entry["layers"] = [{f: getattr(layer, f) for f in _LAYER_FIELDS} for layer in d.layers]
                for out, layer in zip(entry["layers"], d.layers):
                    for key in ("activation_bytes", "precision", "attention"):
                        if getattr(layer, key) is not None:
                            out[key] = getattr(layer, key)
            if d.edges:
                entry["edges"] = [{f: getattr(edge, f) for f in _EDGE_FIELDS} for edge in d.edges]
            if d.optimizer_s_per_param is not None:
                entry["optimizer_s_per_param"] = d.optimizer_s_per_param
            if d.microbatch_overhead_s is not None:
                entry["microbatch_overhead_s"] = d.microbatch_overhead_s
            if d.memory_baseline_GiB is not None:
                entry["memory_baseline_GiB"] = d.memory_baseline_GiB
            if d.state_bytes_per_param is not None:
                entry["state_bytes_per_param"] = d.state_bytes_per_param
            if d.activation_memory_factor is not None:
                entry["activation_memory_factor"] = d.activation_memory_factor
            for key in _CURVES:
                if getattr(d, key):
                    entry[key] = [[x, y] for x, y in getattr(d, key)]
            devices[d.name] = entry
        links: dict[str, Any] = {}
        for nl in self.links:
            links[nl.node] = {
                kind: {"bandwidth_GBps": spec.bandwidth_GBps, "latency_us": spec.latency_us}
                for kind, spec in (("intra_node", nl.intra_node), ("network", nl.network))
                if spec is not None
            }
        return {
            "format_version": FORMAT_VERSION,
            "created": self.created,
            "cluster": self.cluster,
            "versions": dict(self.versions),
            "devices": devices,
            "links": links,
            "step_overhead_s": self.step_overhead_s,
            "notes": self.notes,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> CalibrationProfile:
        if not isinstance(data, Mapping):
            raise SpecError(source, "", f"must be a JSON object, got {type(data).__name__}")
        extra = sorted(
            set(data)
            - {"format_version", "created", "cluster", "versions", "devices", "links", "step_overhead_s", "notes"}
        )
        if extra:
            raise SpecError(source, extra[0], "unknown field")
        version = data.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise SpecError(source, "format_version", f"must be {FORMAT_VERSION}, got {shown(version)}")
        devices_raw = data.get("devices")
        if not isinstance(devices_raw, Mapping) or not devices_raw:
            raise SpecError(source, "devices", "is required and must map device names to measurements")
        devices = tuple(_device_from_dict(source, str(name), raw) for name, raw in devices_raw.items())
        links_raw = data.get("links", {})
        if not isinstance(links_raw, Mapping):
            raise SpecError(source, "links", "must map node names to {intra_node, network}")
        links = []
        for node, raw in links_raw.items():
            f = f"links.{node}"
            if not isinstance(raw, Mapping):
                raise SpecError(source, f, "must be a mapping with intra_node and/or network")
            extra = sorted(set(raw) - {"intra_node", "network"})
            if extra:
                raise SpecError(source, f"{f}.{extra[0]}", "unknown field (expected intra_node, network)")
            specs = {}
            for kind in ("intra_node", "network"):
                if kind in raw:
                    specs[kind] = _link_from_dict(source, f"{f}.{kind}", raw[kind])
            links.append(NodeLinks(str(node), **specs))
        versions = data.get("versions", {})
        if not isinstance(versions, Mapping):
            raise SpecError(source, "versions", "must map package names to version strings")
        overhead = _number(source, "step_overhead_s", data.get("step_overhead_s", 0.0), positive=False)
        return cls(
            devices=devices,
            links=tuple(links),
            created=str(data.get("created", "")),
            cluster=str(data.get("cluster", "")),
            versions=tuple((str(k), str(v)) for k, v in versions.items()),
            step_overhead_s=overhead,
            notes=str(data.get("notes", "")),
        )

    @classmethod
    def load(cls, path: str | Path) -> CalibrationProfile:
        from autotune.documents import read_document

        return cls.from_dict(read_document(path, fmt="json"), str(path))


def _link_from_dict(source: str, field: str, raw: Any) -> LinkSpec:
    if not isinstance(raw, Mapping) or "bandwidth_GBps" not in raw:
        raise SpecError(source, field, "must be a mapping like {bandwidth_GBps: 300, latency_us: 2}")
    bw = _number(source, f"{field}.bandwidth_GBps", raw["bandwidth_GBps"])
    lat = _number(source, f"{field}.latency_us", raw.get("latency_us", 0.0), positive=False)
    return LinkSpec(bw, lat)


def _device_from_dict(source: str, name: str, raw: Any) -> DeviceProfile:
    f = f"devices.{name}"
    if not isinstance(raw, Mapping):
        raise SpecError(source, f, "must be a mapping with matmul_tflops")
    allowed = {
        "matmul_tflops",
        "memory_bandwidth_GBps",
        "layers",
        "edges",
        "optimizer_s_per_param",
        "microbatch_overhead_s",
        "memory_baseline_GiB",
        "state_bytes_per_param",
        "activation_memory_factor",
        "source",
        "matmul_roofline",
        *_CURVES,
    }
    extra = sorted(set(raw) - allowed)
    if extra:
        raise SpecError(source, f"{f}.{extra[0]}", f"unknown field (expected one of {', '.join(sorted(allowed))})")
    points_raw = raw.get("matmul_tflops", [])
    if not isinstance(points_raw, list) or not (points_raw or raw.get("layers")):
        raise SpecError(
            source,
            f"{f}.matmul_tflops",
            "is required (unless the device has measured layers): a non-empty list of [n, tflops] pairs",
        )
    points = _pairs(source, f"{f}.matmul_tflops", points_raw, "[n, tflops]")
    if len({n for n, _ in points}) != len(points):
        raise SpecError(source, f"{f}.matmul_tflops", "lists the same size twice")
    bw = raw.get("memory_bandwidth_GBps")
    if bw is not None:
        bw = _number(source, f"{f}.memory_bandwidth_GBps", bw)
    layers = _layers_from_dict(source, f, raw.get("layers", []))
    edges = []
    for ef, er in _records(
        source, f"{f}.edges", raw.get("edges", []), required=_EDGE_FIELDS, allowed=set(_EDGE_FIELDS)
    ):
        ints = {k: _integer(source, f"{ef}.{k}", er[k]) for k in _EDGE_FIELDS[:5]}
        times = {k: _number(source, f"{ef}.{k}", er[k], positive=False) for k in _EDGE_FIELDS[5:]}
        edges.append(EdgeTiming(**ints, **times))
    opt = raw.get("optimizer_s_per_param")
    if opt is not None:
        opt = _number(source, f"{f}.optimizer_s_per_param", opt, positive=False)
    extras: dict[str, Any] = {}
    for key in ("microbatch_overhead_s", "memory_baseline_GiB", "state_bytes_per_param", "activation_memory_factor"):
        if raw.get(key) is not None:
            extras[key] = _number(source, f"{f}.{key}", raw[key], positive=False)
    curves = {
        key: _pairs(source, f"{f}.{key}", raw.get(key, []), what, positive=key == "contention")
        for key, what in _CURVES.items()
    }
    dev_source = raw.get("source", "")
    if not isinstance(dev_source, str):
        raise SpecError(source, f"{f}.source", f"must be a string, got {dev_source!r}")
    roofline = raw.get("matmul_roofline", False)
    if not isinstance(roofline, bool):
        raise SpecError(source, f"{f}.matmul_roofline", f"must be true or false, got {shown(roofline)}")
    kw = dict(**curves, **extras, source=dev_source, matmul_roofline=roofline)
    return DeviceProfile(name, points, bw, tuple(layers), tuple(edges), opt, **kw)


def _layers_from_dict(source: str, f: str, raw: Any) -> list[LayerTiming]:
    """The ``layers`` entries of device field ``f``."""
    layers = []
    for lf, lr in _records(
        source,
        f"{f}.layers",
        raw,
        required=[k for k in _LAYER_FIELDS if k not in ("num_kv_heads", "recompute")],
        allowed={*_LAYER_FIELDS, "activation_bytes", "precision", "attention"},
    ):
        if lr["mlp"] not in MLP_KINDS:
            raise SpecError(source, f"{lf}.mlp", f"must be one of {', '.join(MLP_KINDS)}, got {shown(lr['mlp'])}")
        ints = {
            k: _integer(source, f"{lf}.{k}", lr[k])
            for k in ("hidden_size", "num_heads", "ffn_hidden_size", "seq_len", "micro_batch_size", "tp")
        }
        kv = _integer(source, f"{lf}.num_kv_heads", lr.get("num_kv_heads", lr["num_heads"]))
        recompute = lr.get("recompute", False)
        if not (isinstance(recompute, bool) or recompute in ("selective", "selective-op")):
            raise SpecError(
                source, f"{lf}.recompute", f'must be true, false, "selective" or "selective-op", got {shown(recompute)}'
            )
        act = lr.get("activation_bytes")
        if act is not None:
            act = _number(source, f"{lf}.activation_bytes", act, positive=False)
        kinds = {}
        for key, allowed_values in (("precision", PRECISIONS), ("attention", ATTENTION_KINDS)):
            if lr.get(key) is not None:
                if lr[key] not in allowed_values:
                    raise SpecError(
                        source, f"{lf}.{key}", f"must be one of {', '.join(allowed_values)}, got {lr[key]!r}"
                    )
                kinds[key] = lr[key]
        layers.append(
            LayerTiming(
                num_kv_heads=kv,
                mlp=lr["mlp"],
                recompute=recompute,
                activation_bytes=act,
                **kinds,
                forward_s=_number(source, f"{lf}.forward_s", lr["forward_s"]),
                backward_s=_number(source, f"{lf}.backward_s", lr["backward_s"]),
                **ints,
            )
        )
    return layers


def _records(source: str, field: str, raw: Any, required, allowed: set[str]):
    """``(field path, mapping)`` for each entry of a list of mappings, each holding every ``required``
    key and no key outside ``allowed``."""
    if not isinstance(raw, list):
        raise SpecError(source, field, "must be a list")
    for i, rec in enumerate(raw):
        rf = f"{field}[{i}]"
        if not isinstance(rec, Mapping):
            raise SpecError(source, rf, "must be a mapping")
        missing = [k for k in required if k not in rec]
        if missing:
            raise SpecError(source, f"{rf}.{missing[0]}", "is required")
        extra = sorted(set(rec) - allowed)
        if extra:
            raise SpecError(source, f"{rf}.{extra[0]}", "unknown field")
        yield rf, rec


def _piecewise_linear(points: tuple[tuple[float, float], ...] | list[tuple[float, float]], x: float) -> float:
    """``points`` (``(x, y)``, at least one) at ``x``: the first ``y`` below the first point, linear
    between points, proportional to ``x`` past the last point (processor sharing)."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        n, y = pts[-1]
        return y * x / n
    i = bisect.bisect_right([n for n, _ in pts], x)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return y0 + (x - x0) / (x1 - x0) * (y1 - y0)


def _rank_curve(points: tuple[tuple[float, float], ...], ranks: float) -> float:
    """A ``[ranks, seconds]`` curve at ``ranks``: 0 at one rank, linear between points, proportional to
    ``ranks`` past the last point."""
    if not points or ranks <= 1:
        return 0.0
    return max(0.0, _piecewise_linear([(1.0, 0.0), *(p for p in points if p[0] > 1)], ranks))


def _pairs(source: str, field: str, raw: Any, what: str, positive: bool = True) -> tuple[tuple[float, float], ...]:
    """A list of ``[x, y]`` number pairs (``x`` > 0; ``y`` > 0 unless ``positive`` is False)."""
    if not isinstance(raw, list):
        raise SpecError(source, field, f"must be a list of {what} pairs")
    out = []
    for i, pt in enumerate(raw):
        if not isinstance(pt, list) or len(pt) != 2:
            raise SpecError(source, f"{field}[{i}]", f"must be a pair {what}, got {shown(pt)}")
        out.append(
            (_number(source, f"{field}[{i}][0]", pt[0]), _number(source, f"{field}[{i}][1]", pt[1], positive=positive))
        )
    return tuple(out)
