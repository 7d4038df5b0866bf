"""Turn cluster / model / config files (or preset names) into typed specs, once, with clear errors.

Each loaded spec is cached by resolved path, modification time and size, so a library caller that
passes the same paths again (``autotune.simulate(path, path, path)`` in a loop) parses nothing
twice; editing a file invalidates its entry.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from autotune.catalog import CLUSTER_PRESETS, GPU_CATALOG, MODEL_PRESETS
from autotune.documents import read_document
from autotune.errors import SpecError, shown
from autotune.hf_config import HFModel, hf_config_path, model_from_hf
from autotune.specs import (
    MAX_DEVICES,
    ClusterSpec,
    DeviceSpec,
    HostSpec,
    LinkSpec,
    ModelSpec,
    NodeSpec,
    ParallelConfig,
    default_host,
    limit_of,
    positive,
)

PathLike = str | Path
MAX_NAME_CHARS = 128


_CACHE_MAX = 256
_cache: dict[tuple, Any] = {}
T = TypeVar("T")


def _cached(kind: str, path: Path, build: Callable[[], T]) -> T:
    """``build()`` once per (kind, file, mtime, size); specs are frozen, so sharing them is safe."""
    try:
        st = os.stat(path)
    except OSError:
        return build()  # build() reports the unreadable file
    key = (kind, os.path.abspath(path), st.st_mtime_ns, st.st_size)
    hit = _cache.get(key)
    if hit is None:
        hit = build()
        if len(_cache) >= _CACHE_MAX:
            _cache.pop(next(iter(_cache)))
        _cache[key] = hit
    return hit


def _read_mapping(path: Path) -> dict[str, Any]:
    """A file's top-level mapping, read with the bounds of ``autotune.documents``."""
    source = str(path)
    data = read_document(path)
    if not isinstance(data, dict):
        raise SpecError(source, "", f"must be a mapping at the top level, got {type(data).__name__}")
    return data


def _name(source: str, field: str, raw: Any, limit: int = MAX_NAME_CHARS) -> str:
    """A name field: a non-empty string of at most ``limit`` characters (``name: null`` is not one)."""
    if not isinstance(raw, str) or not raw.strip():
        raise SpecError(source, field, f"must be a non-empty string, got {shown(raw)}")
    if len(raw) > limit:
        raise SpecError(source, field, f"must be at most {limit} characters, got {len(raw):,}")
    return raw


def _is_path(ref: PathLike) -> bool:
    return isinstance(ref, Path) or str(ref).endswith((".yaml", ".yml", ".json")) or "/" in str(ref)


def _only(source: str, field: str, data: Mapping[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(data) - allowed, key=str)
    if extra:
        prefix = f"{field}." if field else ""
        raise SpecError(source, prefix + str(extra[0]), f"unknown field (expected one of {', '.join(sorted(allowed))})")


def _rebase(source: str, field: str, err: SpecError) -> SpecError:
    """Re-anchor an error raised inside a spec constructor at the file and field it came from."""
    inner = f"{field}.{err.field}" if field and err.field else (field or err.field)
    return SpecError(source, inner, err.rule)


def _link(source: str, field: str, raw: Any) -> LinkSpec:
    if not isinstance(raw, Mapping):
        raise SpecError(source, field, "must be a mapping like {bandwidth_GBps: 300, latency_us: 2}")
    _only(source, field, raw, {"bandwidth_GBps", "latency_us"})
    if "bandwidth_GBps" not in raw:
        raise SpecError(source, f"{field}.bandwidth_GBps", "is required")
    try:
        return LinkSpec(raw["bandwidth_GBps"], raw.get("latency_us", 0.0))
    except SpecError as e:
        raise _rebase(source, field, e) from None


def _device(source: str, field: str, raw: Any) -> DeviceSpec:
    if isinstance(raw, str):
        if raw not in GPU_CATALOG:
            raise SpecError(
                source,
                field,
                f"unknown GPU {shown(raw)}; the catalog has {', '.join(GPU_CATALOG)} "
                "(or give {name, peak_tflops, memory_GiB, memory_bandwidth_GBps})",
            )
        return GPU_CATALOG[raw]
    if not isinstance(raw, Mapping):
        raise SpecError(source, field, "must be a catalog name or a mapping")
    _only(
        source,
        field,
        raw,
        {
            "name",
            "peak_tflops",
            "memory_GiB",
            "memory_bandwidth_GBps",
            "source",
            "pcie_gen",
            "pcie_lanes",
            "peak_tflops_tf32",
            "peak_tflops_fp32",
        },
    )
    base = GPU_CATALOG.get(str(raw.get("name")))
    values = {}
    for key in ("peak_tflops", "memory_GiB", "memory_bandwidth_GBps"):
        if key in raw:
            values[key] = raw[key]
        elif base is not None:
            values[key] = getattr(base, key)
        else:
            raise SpecError(source, f"{field}.{key}", "is required for a GPU not in the catalog")
    for key in ("pcie_gen", "pcie_lanes", "peak_tflops_tf32", "peak_tflops_fp32"):
        # optional: the catalog entry's; else PCIe 4.0 x16 and peaks derived from peak_tflops
        if key in raw:
            values[key] = raw[key]
        elif base is not None:
            values[key] = getattr(base, key)
    if "name" not in raw:
        raise SpecError(source, f"{field}.name", "is required")
    try:
        return DeviceSpec(
            _name(source, f"{field}.name", raw["name"]),
            source=_name(source, f"{field}.source", raw.get("source", "cluster file"), limit=500),
            **values,
        )
    except SpecError as e:
        raise SpecError(source, f"{field}.{e.field}", e.rule) from None


def _host(source: str, field: str, raw: Any, device: DeviceSpec, count: int) -> HostSpec:
    """A node's ``host: {memory_GiB, link, bandwidth_GBps}``; what it leaves out comes from
    ``default_host`` (the documented default memory, the GPU type's PCIe link)."""
    if not isinstance(raw, Mapping):
        raise SpecError(source, field, "must be a mapping like {memory_GiB: 512, link: {bandwidth_GBps: 25}}")
    _only(source, field, raw, {"memory_GiB", "link", "bandwidth_GBps"})
    default = default_host(device, count)
    link = _link(source, f"{field}.link", raw["link"]) if "link" in raw else default.link
    try:
        return HostSpec(raw.get("memory_GiB", default.memory_GiB), link, raw.get("bandwidth_GBps", 0.0))
    except SpecError as e:
        raise _rebase(source, field, e) from None


def cluster_from_dict(data: Mapping[str, Any], source: str, default_name: str = "cluster") -> ClusterSpec:
    _only(source, "", data, {"name", "nodes", "network"})
    network = _link(source, "network", data["network"]) if "network" in data else None
    nodes_raw = data.get("nodes")
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise SpecError(source, "nodes", "is required and must be a non-empty list")
    nodes: list[NodeSpec] = []
    devices = 0
    for i, raw in enumerate(nodes_raw):
        f = f"nodes[{i}]"
        if not isinstance(raw, Mapping):
            raise SpecError(source, f, "must be a mapping")
        _only(source, f, raw, {"name", "gpu", "count", "intra_node", "network", "slowdown", "repeat", "host"})
        for key in ("name", "gpu", "count"):
            if key not in raw:
                raise SpecError(source, f"{f}.{key}", "is required")
        device = _device(source, f"{f}.gpu", raw["gpu"])
        intra = _link(source, f"{f}.intra_node", raw["intra_node"]) if "intra_node" in raw else LinkSpec(16.0, 5.0)
        node_net = _link(source, f"{f}.network", raw["network"]) if "network" in raw else network
        if node_net is None:
            raise SpecError(source, "network", "is required (each node's bandwidth to the others)")
        slowdown = raw.get("slowdown", 1.0)
        if slowdown != 1.0 and device.name != "cpu":
            raise SpecError(source, f"{f}.slowdown", "is CPU emulation only: allowed on gpu 'cpu' nodes")
        repeat = raw.get("repeat", 1)
        positive(source, f"{f}.repeat", repeat, integer=True)
        node_name = _name(source, f"{f}.name", raw["name"])
        names = [node_name] if repeat == 1 else [f"{node_name}-{k}" for k in range(repeat)]
        count = raw["count"]
        positive(source, f"{f}.count", count, integer=True)
        devices += count * repeat
        if devices > MAX_DEVICES:
            raise SpecError(
                source,
                f,
                f"the cluster has more than {MAX_DEVICES:,} devices (the documented limit) "
                f"with this node's {count} x {repeat}",
            )
        host = None
        if "host" in raw:
            host = _host(source, f"{f}.host", raw["host"], device, count)
        for name in names:
            try:
                nodes.append(NodeSpec(name, device, count, intra, node_net, slowdown, host))
            except SpecError as e:
                raise SpecError(source, f"{f}.{e.field}", e.rule) from None
    try:
        return ClusterSpec(_name(source, "name", data.get("name", default_name)), tuple(nodes))
    except SpecError as e:
        raise SpecError(source, e.field, e.rule) from None


def load_cluster(ref: PathLike | ClusterSpec) -> ClusterSpec:
    """A cluster from a YAML/JSON path or a preset name (``autotune.catalog.CLUSTER_PRESETS``)."""
    if isinstance(ref, ClusterSpec):
        return ref
    if not _is_path(ref):
        if str(ref) not in CLUSTER_PRESETS:
            raise SpecError(
                "--cluster", "", f"no file or preset named {shown(str(ref))}; presets: {', '.join(CLUSTER_PRESETS)}"
            )
        return cluster_from_dict({"name": str(ref), **CLUSTER_PRESETS[str(ref)]}, f"preset {shown(ref)}")
    path = Path(ref)
    return _cached("cluster", path, lambda: cluster_from_dict(_read_mapping(path), str(path), default_name=path.stem))


_MODEL_FIELDS = {
    "name",
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "mlp",
    "vocab_size",
    "seq_len",
    "global_batch_size",
    "precision",
    "attention",
    "dropout",
}
_MODEL_OPTIONAL = {"name", "num_kv_heads", "mlp", "precision", "attention", "dropout"}
# optional mixture-of-experts fields (SPEC.md "Extensions")
_MOE_MODEL_FIELDS = {"num_experts", "experts_per_token", "expert_ffn_hidden_size", "moe_layer_every"}
_MODEL_FIELDS |= _MOE_MODEL_FIELDS
# optional architecture details of Hugging Face families (SPEC.md "Extensions, second set")
_DETAIL_MODEL_FIELDS = {
    "head_dim",
    "bias",
    "tied_embeddings",
    "learned_positions",
    "sliding_window",
    "shared_expert_ffn_hidden_size",
    "shared_expert_gate",
    "first_dense_layers",
    "qk_norm",
    "rope_theta",
    "rms_norm_eps",
}
_MODEL_FIELDS |= _DETAIL_MODEL_FIELDS
_MODEL_OPTIONAL |= _DETAIL_MODEL_FIELDS


def model_from_dict(data: Mapping[str, Any], source: str, default_name: str = "model") -> ModelSpec:
    _only(source, "", data, _MODEL_FIELDS)
    for key in sorted(_MODEL_FIELDS - _MODEL_OPTIONAL - _MOE_MODEL_FIELDS):
        if key not in data:
            raise SpecError(source, key, "is required")
    values = {k: data[k] for k in _MODEL_FIELDS - {"name"} if k in data}
    try:
        return ModelSpec(name=_name(source, "name", data.get("name", default_name)), **values)
    except SpecError as e:
        raise SpecError(source, e.field, e.rule) from None


def load_hf_model(ref: PathLike, seq_len: int | None = None, global_batch_size: int | None = None) -> HFModel | None:
    """The model of a Hugging Face ``config.json`` (``ref`` the file or its directory), with what the
    reading decided (``autotune.hf_config``); None when ``ref`` is no such config."""
    if isinstance(ref, ModelSpec):
        return None
    path = hf_config_path(ref)
    if path is None:
        return None
    if seq_len is not None:
        positive("--seq-len", "", seq_len, integer=True, maximum=limit_of("seq_len"))
    if global_batch_size is not None:
        positive("--global-batch-size", "", global_batch_size, integer=True, maximum=limit_of("global_batch_size"))
    return _cached(
        f"hf-model-{seq_len}-{global_batch_size}",
        path,
        lambda: model_from_hf(_read_mapping(path), str(path), seq_len, global_batch_size),
    )


def load_model(
    ref: PathLike | ModelSpec, global_batch_size: int | None = None, seq_len: int | None = None
) -> ModelSpec:
    """A model from a YAML/JSON path, a Hugging Face ``config.json`` (or its directory) or a preset
    name; ``global_batch_size`` and ``seq_len`` override the file's."""
    hf = load_hf_model(ref, seq_len, global_batch_size)
    if hf is not None:
        return hf.model
    if isinstance(ref, ModelSpec):
        model = ref
    elif not _is_path(ref):
        if str(ref) not in MODEL_PRESETS:
            raise SpecError(
                "--model", "", f"no file or preset named {shown(str(ref))}; presets: {', '.join(MODEL_PRESETS)}"
            )
        model = model_from_dict({"name": str(ref), **MODEL_PRESETS[str(ref)]}, f"preset {shown(ref)}")
    else:
        path = Path(ref)
        if path.is_dir():
            raise SpecError(
                str(path), "", "is a directory without config.json (a Hugging Face model directory holds one)"
            )
        model = _cached("model", path, lambda: model_from_dict(_read_mapping(path), str(path), default_name=path.stem))
    if global_batch_size is not None:
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise SpecError("--global-batch-size", "", f"must be a positive integer, got {shown(global_batch_size)}")
        positive("--global-batch-size", "", global_batch_size, integer=True, maximum=limit_of("global_batch_size"))
        model = model.with_global_batch_size(global_batch_size)
    if seq_len is not None and seq_len != model.seq_len:
        from dataclasses import replace

        positive("--seq-len", "", seq_len, integer=True, maximum=limit_of("seq_len"))
        try:
            model = replace(model, seq_len=seq_len)
        except SpecError as e:
            raise SpecError("--seq-len", e.field, e.rule) from None
    return model


def load_config(ref: PathLike | ParallelConfig | Mapping[str, Any]) -> ParallelConfig:
    """A parallel config from a JSON path, a dict, or a config (returned as is)."""
    if isinstance(ref, ParallelConfig):
        return ref
    if isinstance(ref, Mapping):
        return ParallelConfig.from_dict(ref)
    path = Path(ref)
    return _cached("config", path, lambda: ParallelConfig.from_dict(_read_mapping(path), str(path)))
