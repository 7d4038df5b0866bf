"""Random but realistic (cluster, model) scenarios for training the RL chooser, and the held-out set.

``draw_scenario(rng)`` returns one ``Scenario``: a ``ClusterSpec`` whose GPU types come from
``autotune.catalog.GPU_CATALOG`` (never ``cpu``), 4 to 128 GPUs on 1 to 16 nodes, NVLink-class
(150-450 GBps) or PCIe-class (8-32 GBps) links inside nodes and 1 Gbit/s (0.125 GBps) to 400 Gbit/s
(50 GBps) between them; and a ``ModelSpec`` that is a preset or a random decoder shape (hidden size
= heads x head_dim, kv heads divide heads, TP-friendly FFN), with a global batch size. Every drawn
scenario has at least one plan that runs on the simulator (``feasible``): models too big for the
cluster are redrawn.

Since issue 16 the policy trains on ``draw_scenario``'s wider mixture (``SCENARIO_KINDS``), each draw
one of: ``classic`` (the generator above, on ``TRAINING_GPU_TYPES``, with a host-memory limit on 30%
of the nodes), ``tight`` (consumer or cloud cards, ``TIGHT_GPU_TYPES``, a model whose training state is
0.4-1.5x the cluster's device memory, so ZeRO, offload and recomputation decide what fits, and a host
memory of 0.5-4x the node's device memory), ``internet`` (2-16 standalone nodes joined by 0.1-1 GB/s
links of 1-100 ms latency), ``moe`` (an MoE model: a random MoE shape, SPES-2B or Mixtral-8x7B, on a
classic or internet cluster) and ``large`` (128-1,024 GPUs on nodes of 8). ``draw_cluster`` and
``draw_model`` alone still draw the first generator's distribution.

The train / held-out split is structural:

- **GPU mixes**: ``HELDOUT_MIXES`` are sets of GPU types that training never draws (a training
  cluster whose set of GPU types equals a held-out mix is rejected and redrawn). Every held-out
  scenario uses one of them, so no held-out cluster's mix of devices was seen in training.
- **Scenarios**: ``heldout_scenarios()`` is a fixed, hand-written list (not drawn from a seed), with
  shapes chosen to be unlike the bulk of the training draws: a 4-node cluster joined by a 1 Gbit/s
  internet link, a 128-GPU cluster, a homogeneous cluster of a held-out type, 3-type mixes, and (issue
  16) two memory-tight clusters (consumer cards, a cloud T4/L4/A10G mix) and an MoE model (SPES-2B)
  on standalone nodes joined by the internet.
- **Seeds**: training draws from ``training_rng(seed)`` (a ``SeedSequence`` with spawn key
  ``TRAIN_SPAWN_KEY``); anything else that needs random scenarios (validation while developing the
  policy) uses ``validation_rng`` (a different spawn key). The held-out list uses no randomness.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from autotune.catalog import GPU_CATALOG, MODEL_PRESETS
from autotune.specs import ClusterSpec, LinkSpec, ModelSpec, NodeSpec

log = logging.getLogger(__name__)

#: the accelerators scenarios draw from: the catalog as it was when the shipped policy was trained (``cpu`` is
#: the local test device, not a scenario GPU). GPUs added to the catalog later (GH200, L40S, TITAN-RTX,
#: RTX-2080-Ti, RTX-2080, A800-80GB) join when the policy is retrained, so the generator's draws stay as they were.
GPU_TYPES: tuple[str, ...] = (
    "H200",
    "H100-80GB",
    "A100-80GB",
    "A100-40GB",
    "V100-32GB",
    "A10G",
    "L4",
    "T4",
    "RTX-4090",
    "RTX-3090",
    "A6000",
)
#: SXM-socket datacenter parts: nodes of 4 or 8 usually joined by NVLink / NVSwitch
NVLINK_CAPABLE = frozenset({"H200", "H100-80GB", "A100-80GB", "A100-40GB", "V100-32GB"})

#: GPU-type sets that training never draws; every held-out scenario uses one of them
HELDOUT_MIXES: tuple[frozenset[str], ...] = (
    frozenset({"A100-80GB", "RTX-4090"}),
    frozenset({"H200", "V100-32GB"}),
    frozenset({"H100-80GB", "L4"}),
    frozenset({"A6000", "RTX-3090", "T4"}),
    frozenset({"A100-40GB", "A10G"}),
    frozenset({"H100-80GB", "A100-80GB", "V100-32GB"}),
    frozenset({"L4"}),
    frozenset({"H200", "A6000", "A10G", "T4"}),
    # issue 16: memory-tight consumer and cloud clusters, an MoE model over the internet
    frozenset({"RTX-3090", "RTX-4090"}),
    frozenset({"T4", "L4", "A10G"}),
    frozenset({"L40S", "RTX-4090"}),
)

#: what the policy trains on since issue 16: the first list and the catalog GPUs added since
TRAINING_GPU_TYPES: tuple[str, ...] = GPU_TYPES + ("GH200", "L40S", "TITAN-RTX", "RTX-2080-Ti", "RTX-2080", "A800-80GB")
#: consumer and cloud cards (``tight`` draws)
TIGHT_GPU_TYPES: tuple[str, ...] = (
    "RTX-4090",
    "RTX-3090",
    "RTX-2080-Ti",
    "RTX-2080",
    "TITAN-RTX",
    "A6000",
    "T4",
    "L4",
    "A10G",
    "L40S",
)
#: the kinds of ``draw_scenario``'s mixture and their probabilities
SCENARIO_KINDS: dict[str, float] = {"classic": 0.36, "tight": 0.27, "internet": 0.17, "moe": 0.16, "large": 0.04}
#: internet links between standalone nodes: 0.1-1 GB/s, 1-100 ms (log-uniform)
INTERNET_GBPS = (0.1, 1.0)
INTERNET_LATENCY_US = (1_000.0, 100_000.0)
MAX_LARGE_GPUS = 1024
#: a ``tight`` draw's training state (16 bytes per parameter) over the cluster's device memory
TIGHT_STATE_SHARE = (0.4, 1.5)
HOST_MEMORY_PER_DEVICE_MEMORY = (0.5, 4.0)

TRAIN_SPAWN_KEY = 1
VALIDATION_SPAWN_KEY = 2

# Ranges from the issue: NVLink-class / PCIe-class inside a node, 1 Gbit/s .. 400 Gbit/s between nodes.
NVLINK_GBPS = (150.0, 450.0)
PCIE_GBPS = (8.0, 32.0)
NETWORK_GBPS = (0.125, 50.0)
MIN_GPUS, MAX_GPUS = 4, 128
MAX_NODES = 16
#: mixed-precision Adam keeps 16 bytes per parameter (Rajbhandari et al. 2020, ZeRO sec. 3.1);
#: a model is drawn only if that state fits in this share of the cluster's total memory
WEIGHT_STATE_BYTES = 16
MAX_STATE_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class Scenario:
    """One search problem: a cluster, a model (with its global batch size) and a name."""

    name: str
    cluster: ClusterSpec
    model: ModelSpec

    @property
    def gpu_types(self) -> frozenset[str]:
        return frozenset(n.device.name for n in self.cluster.nodes)

    @property
    def mixed(self) -> bool:
        return len(self.gpu_types) > 1

    def describe(self) -> str:
        parts = []
        for t in sorted(self.gpu_types):
            nodes = [n for n in self.cluster.nodes if n.device.name == t]
            parts.append(f"{len(nodes)}x{nodes[0].count} {t}")
        net = self.cluster.nodes[0].network.bandwidth_GBps
        return (
            f"{self.name}: {' + '.join(parts)} ({self.cluster.num_devices} GPUs, net {net:g} GBps) / "
            f"{self.model.name} L{self.model.num_layers} h{self.model.hidden_size} gbs {self.model.global_batch_size}"
        )


def training_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(TRAIN_SPAWN_KEY,)))


def validation_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(VALIDATION_SPAWN_KEY,)))


# --------------------------------------------------------------------------------------------------
# Clusters


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _intra_link(rng: np.random.Generator, gpu: str) -> LinkSpec:
    if gpu in NVLINK_CAPABLE and rng.random() < 0.8:
        return LinkSpec(round(float(rng.uniform(*NVLINK_GBPS)), 1), round(float(rng.uniform(1, 3)), 1))
    return LinkSpec(round(float(rng.uniform(*PCIE_GBPS)), 1), round(float(rng.uniform(3, 8)), 1))


def draw_cluster(
    rng: np.random.Generator,
    *,
    exclude_mixes: tuple[frozenset[str], ...] = HELDOUT_MIXES,
    name: str = "cluster",
    gpu_types: tuple[str, ...] = GPU_TYPES,
) -> ClusterSpec:
    """A random cluster of ``gpu_types``; its set of GPU types is never one of ``exclude_mixes``."""
    for _ in range(1000):
        n_types = int(rng.choice([1, 2, 3, 4], p=[0.15, 0.45, 0.3, 0.1]))
        types = [str(t) for t in rng.choice(gpu_types, size=n_types, replace=False)]
        if frozenset(types) in exclude_mixes:
            continue
        nodes: list[NodeSpec] = []
        net = LinkSpec(round(_log_uniform(rng, *NETWORK_GBPS), 3), round(float(rng.uniform(5, 50)), 1))
        for t in types:
            per_node = int(rng.choice([8, 4])) if t in NVLINK_CAPABLE else int(rng.choice([1, 2, 4, 8]))
            n_nodes = int(rng.choice([1, 1, 1, 2, 2, 3, 4, 6, 8]))
            intra = _intra_link(rng, t)
            for k in range(n_nodes):
                nodes.append(NodeSpec(f"{t.lower()}-{k}".replace(".", "_"), GPU_CATALOG[t], per_node, intra, net))
        gpus = sum(n.count for n in nodes)
        if len(nodes) <= MAX_NODES and MIN_GPUS <= gpus <= MAX_GPUS:
            return ClusterSpec(name, tuple(nodes))
    raise RuntimeError("could not draw a cluster within the limits")  # pragma: no cover (probability ~0)


# --------------------------------------------------------------------------------------------------
# Models

_PRESETS_FOR_TRAINING = ("gpt2-small", "gpt2-xl", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b")


def draw_model(rng: np.random.Generator, name: str = "model") -> ModelSpec:
    """A preset (1 in 3) or a random GPT/Llama-style shape, with a random global batch size."""
    # smaller batches weighted up: the simulator's schedule cost grows with the micro-batch count
    gbs = int(rng.choice([64, 128, 256, 512, 1024], p=[0.25, 0.3, 0.25, 0.15, 0.05]))
    if rng.random() < 1 / 3:
        preset = str(rng.choice(_PRESETS_FOR_TRAINING))
        return ModelSpec(
            name=preset,
            global_batch_size=gbs,
            **{k: v for k, v in MODEL_PRESETS[preset].items() if k != "global_batch_size"},
        )
    head_dim = int(rng.choice([64, 128]))
    heads = int(rng.choice([8, 12, 16, 20, 24, 32, 40, 48, 64]))
    hidden = heads * head_dim
    swiglu = bool(rng.random() < 0.5)
    if swiglu:
        ffn = int(round(hidden * 8 / 3 / 256)) * 256  # Llama: ~8/3 h, rounded to a multiple of 256
        kv = int(rng.choice([d for d in (heads, heads // 2, heads // 4, 8) if d >= 1 and heads % d == 0]))
    else:
        ffn, kv = 4 * hidden, heads
    layers = int(rng.choice([12, 16, 20, 24, 28, 32, 36, 40, 48, 60, 64, 80]))
    return ModelSpec(
        name=f"{name}-L{layers}-h{hidden}",
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        mlp="swiglu" if swiglu else "gelu",
        vocab_size=int(rng.choice([32000, 50257, 65536, 128256])),
        seq_len=int(rng.choice([1024, 2048, 4096], p=[0.35, 0.4, 0.25])),
        global_batch_size=gbs,
    )


def state_fits(cluster: ClusterSpec, model: ModelSpec) -> bool:
    total_GiB = sum(n.count * n.device.memory_GiB for n in cluster.nodes)
    return WEIGHT_STATE_BYTES * model.num_params / 2**30 <= MAX_STATE_SHARE * total_GiB


def feasible(cluster: ClusterSpec, model: ModelSpec, max_uniform: int = 40) -> bool:
    """True when some plan runs on the simulator: a speed-proportional start or a uniform plan."""
    from autotune.planning.space import SearchSpace
    from autotune.simulator import Simulator

    space = SearchSpace(cluster, model)
    sim = Simulator(cluster, model)
    for params in space.heuristic_params():
        decoded = space.decode(params)
        if decoded.ok and sim.evaluate(decoded.config).ok:  # type: ignore[arg-type]
            return True
    plans = space.uniform_plans()
    step = max(1, len(plans) // max_uniform)
    return any(sim.evaluate(p).ok for p in plans[::step][:max_uniform])


def draw_scenario(
    rng: np.random.Generator,
    *,
    exclude_mixes: tuple[frozenset[str], ...] = HELDOUT_MIXES,
    name: str = "train",
    check_feasible: bool = True,
    kind: str | None = None,
) -> Scenario:
    """A random scenario of the training mixture (``SCENARIO_KINDS``; ``kind`` forces one) whose GPU mix
    is not held out and that (``check_feasible``) has a plan that runs."""
    for _ in range(200):
        k = kind or str(rng.choice(list(SCENARIO_KINDS), p=list(SCENARIO_KINDS.values())))
        cluster = _DRAW_CLUSTER[k](rng, exclude_mixes, name)
        if cluster is None:
            continue
        for _ in range(20):
            model = draw_moe_model(rng) if k == "moe" else draw_model(rng)
            if not _state_ok(k, cluster, model):
                continue
            if not check_feasible or feasible(cluster, model):
                return Scenario(name, cluster, model)
    raise RuntimeError("could not draw a feasible scenario")  # pragma: no cover


def _state_ok(kind: str, cluster: ClusterSpec, model: ModelSpec) -> bool:
    total_GiB = sum(n.count * n.device.memory_GiB for n in cluster.nodes)
    share = WEIGHT_STATE_BYTES * model.num_params / 2**30 / total_GiB
    if kind == "tight":
        return TIGHT_STATE_SHARE[0] <= share <= TIGHT_STATE_SHARE[1]
    return share <= MAX_STATE_SHARE


def _with_host(rng: np.random.Generator, node: NodeSpec) -> NodeSpec:
    """``node`` with a host-memory limit of 0.5-4x its device memory (its default host link)."""
    from dataclasses import replace

    from autotune.specs import default_host

    gib = max(8.0, round(_log_uniform(rng, *HOST_MEMORY_PER_DEVICE_MEMORY) * node.count * node.device.memory_GiB, 1))
    return replace(node, host=replace(default_host(node.device, node.count), memory_GiB=gib))


def _mixed_types(
    rng: np.random.Generator, pool: tuple[str, ...], exclude: tuple[frozenset[str], ...], weights=(0.3, 0.45, 0.25)
) -> list[str] | None:
    n = int(rng.choice([1, 2, 3], p=list(weights)))
    types = [str(t) for t in rng.choice(pool, size=n, replace=False)]
    return None if frozenset(types) in exclude else types


def _classic_cluster(rng, exclude, name):
    cluster = draw_cluster(rng, exclude_mixes=exclude, name=name, gpu_types=TRAINING_GPU_TYPES)
    nodes = tuple(_with_host(rng, n) if rng.random() < 0.3 else n for n in cluster.nodes)
    return ClusterSpec(name, nodes)


def _tight_cluster(rng, exclude, name):
    types = _mixed_types(rng, TIGHT_GPU_TYPES, exclude)
    if types is None:
        return None
    net = LinkSpec(round(_log_uniform(rng, 0.125, 12.5), 3), round(float(rng.uniform(5, 50)), 1))
    nodes = []
    for t in types:
        per_node = int(rng.choice([1, 2, 4, 8]))
        for k in range(int(rng.choice([1, 1, 2, 2, 3, 4]))):
            nodes.append(
                _with_host(rng, NodeSpec(f"{t.lower()}-{k}", GPU_CATALOG[t], per_node, _intra_link(rng, t), net))
            )
    return _bounded(name, nodes, MIN_GPUS, MAX_GPUS, MAX_NODES)


def _internet_cluster(rng, exclude, name):
    types = _mixed_types(rng, TRAINING_GPU_TYPES, exclude, weights=(0.35, 0.45, 0.2))
    if types is None:
        return None
    net = LinkSpec(round(float(rng.uniform(*INTERNET_GBPS)), 3), round(_log_uniform(rng, *INTERNET_LATENCY_US), 0))
    nodes = []
    for t in types:
        per_node = int(rng.choice([1, 2, 4, 8]))
        for k in range(int(rng.choice([1, 2, 2, 3, 4, 6, 8]))):
            node = NodeSpec(f"{t.lower()}-{k}", GPU_CATALOG[t], per_node, _intra_link(rng, t), net)
            nodes.append(_with_host(rng, node) if rng.random() < 0.3 else node)
    if len(nodes) < 2:
        return None
    return _bounded(name, nodes, MIN_GPUS, MAX_GPUS, MAX_NODES)


def _moe_cluster(rng, exclude, name):
    return _internet_cluster(rng, exclude, name) if rng.random() < 0.5 else _classic_cluster(rng, exclude, name)


def _large_cluster(rng, exclude, name):
    types = _mixed_types(rng, TRAINING_GPU_TYPES, exclude, weights=(0.3, 0.5, 0.2))
    if types is None:
        return None
    target = int(2 ** rng.uniform(math.log2(128), math.log2(MAX_LARGE_GPUS)))
    net = LinkSpec(round(_log_uniform(rng, 3.125, 50.0), 3), round(float(rng.uniform(5, 20)), 1))
    shares = rng.dirichlet(np.ones(len(types)))
    nodes = []
    for t, share in zip(types, shares):
        n_nodes = max(1, int(round(share * target / 8)))
        intra = _intra_link(rng, t)
        nodes += [NodeSpec(f"{t.lower()}-{k}", GPU_CATALOG[t], 8, intra, net) for k in range(n_nodes)]
    return _bounded(name, nodes, MAX_GPUS, MAX_LARGE_GPUS, MAX_LARGE_GPUS // 8)


def _bounded(name, nodes, lo, hi, max_nodes):
    gpus = sum(n.count for n in nodes)
    return ClusterSpec(name, tuple(nodes)) if lo <= gpus <= hi and 1 <= len(nodes) <= max_nodes else None


_DRAW_CLUSTER = {
    "classic": _classic_cluster,
    "tight": _tight_cluster,
    "internet": _internet_cluster,
    "moe": _moe_cluster,
    "large": _large_cluster,
}


def draw_moe_model(rng: np.random.Generator, name: str = "moe") -> ModelSpec:
    """SPES-2B or Mixtral-8x7B (1 in 4), else a random MoE decoder: 8-64 experts, top-1 or top-2,
    experts in every block or every second, with a random global batch size."""
    gbs = int(rng.choice([64, 128, 256, 512, 1024], p=[0.2, 0.3, 0.25, 0.15, 0.1]))
    if rng.random() < 0.25:
        return _preset(str(rng.choice(["spes-2b", "mixtral-8x7b"])), gbs)
    dense = draw_model(rng, name)
    experts = int(rng.choice([8, 16, 32, 64]))
    return ModelSpec(
        name=f"{name}-E{experts}-L{dense.num_layers}-h{dense.hidden_size}",
        num_layers=dense.num_layers,
        hidden_size=dense.hidden_size,
        num_heads=dense.num_heads,
        num_kv_heads=dense.num_kv_heads,
        ffn_hidden_size=dense.ffn_hidden_size,
        mlp=dense.mlp,
        vocab_size=dense.vocab_size,
        seq_len=dense.seq_len,
        global_batch_size=gbs,
        num_experts=experts,
        experts_per_token=int(rng.choice([1, 2])),
        expert_ffn_hidden_size=int(
            rng.choice([dense.ffn_hidden_size // 4, dense.ffn_hidden_size // 2, dense.ffn_hidden_size])
        )
        // 64
        * 64,
        moe_layer_every=int(rng.choice([1, 2])),
    )


# --------------------------------------------------------------------------------------------------
# The held-out set: fixed, hand-written, every one on a held-out GPU mix.


def _nodes(prefix: str, gpu: str, count: int, repeat: int, intra_GBps: float, net: LinkSpec) -> list[NodeSpec]:
    intra = LinkSpec(intra_GBps, 2.0 if intra_GBps >= 100 else 5.0)
    return [NodeSpec(f"{prefix}-{k}", GPU_CATALOG[gpu], count, intra, net) for k in range(repeat)]


def _preset(name: str, gbs: int) -> ModelSpec:
    fields = {k: v for k, v in MODEL_PRESETS[name].items() if k != "global_batch_size"}
    return ModelSpec(name=name, global_batch_size=gbs, **fields)


def heldout_scenarios() -> list[Scenario]:
    """The fixed held-out scenarios (never used in training; see the module docstring)."""
    out = []

    def add(name: str, nodes: list[NodeSpec], model: ModelSpec) -> None:
        out.append(Scenario(name, ClusterSpec(name, tuple(nodes)), model))

    internet = LinkSpec(0.125, 30_000.0)  # 1 Gbit/s over the internet, ~30 ms
    add(
        "internet-4node",
        _nodes("a100", "A100-80GB", 4, 2, 300, internet) + _nodes("rtx4090", "RTX-4090", 4, 2, 16, internet),
        _preset("gpt2-xl", 256),
    )
    add(
        "big-128",
        _nodes("h200", "H200", 8, 6, 450, LinkSpec(50, 5)) + _nodes("v100", "V100-32GB", 8, 10, 300, LinkSpec(50, 5)),
        _preset("llama2-70b", 1024),
    )
    add(
        "h100-l4-32",
        _nodes("h100", "H100-80GB", 8, 2, 450, LinkSpec(12.5, 10)) + _nodes("l4", "L4", 4, 4, 16, LinkSpec(12.5, 10)),
        _preset("llama2-7b", 512),
    )
    add(
        "workstations-20",
        _nodes("a6000", "A6000", 4, 1, 25, LinkSpec(3.125, 20))
        + _nodes("rtx3090", "RTX-3090", 4, 2, 16, LinkSpec(3.125, 20))
        + _nodes("t4", "T4", 4, 2, 12, LinkSpec(3.125, 20)),
        ModelSpec(
            "random-1.3b",
            num_layers=24,
            hidden_size=2048,
            num_heads=16,
            ffn_hidden_size=8192,
            vocab_size=50257,
            seq_len=2048,
            global_batch_size=128,
        ),
    )
    add(
        "a100-a10g-48",
        _nodes("a100", "A100-40GB", 8, 4, 300, LinkSpec(50, 5)) + _nodes("a10g", "A10G", 4, 4, 16, LinkSpec(50, 5)),
        _preset("llama3-8b", 512),
    )
    add(
        "three-gen-24",
        _nodes("h100", "H100-80GB", 8, 1, 450, LinkSpec(12.5, 10))
        + _nodes("a100", "A100-80GB", 8, 1, 300, LinkSpec(12.5, 10))
        + _nodes("v100", "V100-32GB", 8, 1, 150, LinkSpec(12.5, 10)),
        _preset("llama2-13b", 256),
    )
    add("l4-homogeneous-32", _nodes("l4", "L4", 8, 4, 32, LinkSpec(6.25, 10)), _preset("llama2-7b", 256))
    add(
        "four-type-14",
        _nodes("h200", "H200", 2, 1, 450, LinkSpec(3.125, 20))
        + _nodes("a6000", "A6000", 4, 1, 20, LinkSpec(3.125, 20))
        + _nodes("a10g", "A10G", 4, 1, 16, LinkSpec(3.125, 20))
        + _nodes("t4", "T4", 4, 1, 10, LinkSpec(3.125, 20)),
        ModelSpec(
            "random-swiglu-2.7b",
            num_layers=32,
            hidden_size=2560,
            num_heads=20,
            num_kv_heads=4,
            ffn_hidden_size=6912,
            mlp="swiglu",
            vocab_size=32000,
            seq_len=2048,
            global_batch_size=256,
        ),
    )
    # issue 16: where little fits (memory-tight consumer and cloud clusters) and an MoE model trained
    # over the internet (SPES's setting)
    add(
        "consumer-tight-8",
        _nodes("rtx3090", "RTX-3090", 4, 1, 16, LinkSpec(1.25, 50))
        + _nodes("rtx4090", "RTX-4090", 4, 1, 25, LinkSpec(1.25, 50)),
        _preset("llama2-7b", 64),
    )
    add(
        "cloud-tight-16",  # the cluster: 4 T4 + 4 L4 + 8 A10G training Llama-3-8B, global batch 128
        _nodes("t4", "T4", 4, 1, 12, LinkSpec(3.125, 20))
        + _nodes("l4", "L4", 4, 1, 16, LinkSpec(3.125, 20))
        + _nodes("a10g", "A10G", 4, 2, 16, LinkSpec(3.125, 20)),
        _preset("llama3-8b", 128),
    )
    internet_20ms = LinkSpec(0.125, 20_000.0)  # 1 Gbit/s, 20 ms: standalone nodes joined by the internet
    add(
        "moe-internet-16",
        _nodes("l40s", "L40S", 2, 4, 32, internet_20ms) + _nodes("rtx4090", "RTX-4090", 2, 4, 25, internet_20ms),
        _preset("spes-2b", 256),
    )
    for s in out:
        assert s.gpu_types in HELDOUT_MIXES, s.name
    return out
