"""RoundPipe plans in the shared search space: their dimensions, their decoding, RoundPipe's own start plan.

Present only where RoundPipe applies: nodes of GPUs with a host link (``pcie_gen`` > 0; the ``cpu``
device has none). A roundpipe plan uses one node's GPUs as its pool, or every node of one node class,
one pool (replica) each, the batch split evenly. The dimensions (``SearchSpace`` adds them after its
own; they matter only when ``roundpipe`` is true, the pipeline dimensions only when it is false, and
``mbs`` for both):

``roundpipe``    the switch: a roundpipe plan or a pipeline plan.
``rp.pool``      the pool: ``<class>`` (the class's first node) or ``<class>x<k>`` (its ``k`` nodes, each on
                 its own).
``rp.balance``   RoundPipe's ``upper_threshold``: stages packed up to this many times the slowest unit's
                 time (the LM head, or a block's backward).
``rp.memory``    the memory limit as a fraction of the smallest pool GPU (RoundPipe's default 0.6).
``rp.grain``     recompute grain, ``stage`` or ``layer``.
``rp.passes``    forward-backward passes per optimizer step (``accumulation_steps``).

The partition itself is RoundPipe's automatic one (``autotune.simulator.roundpipe_partition.auto_partition``),
computed from the datasheet simulator's unit times for the chosen micro-batch size, balance and limit:
a point of the space is a plan RoundPipe would run with those settings. ``start_params`` is the plan
RoundPipe picks with its defaults (fastest node class, balance 1.1, 60% memory limit, stage grain, one
pass of at least pool + 1 micro-batches): every search method evaluates it first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autotune.errors import SpecError
from autotune.planning.vocabulary import Decoded, Dimension, NodeClass, SpaceContext
from autotune.simulator.roundpipe_partition import auto_stages
from autotune.specs import ClusterSpec, ParallelConfig, PipelineConfig
from autotune.specs.roundpipe import RECOMPUTE_GRAINS, ROUNDPIPE, RoundPipeStages

SWITCH = "roundpipe"
BALANCES = (1.0, 1.1, 1.25, 1.5, 2.0)
MEMORY_FRACTIONS = (0.4, 0.5, 0.6, 0.7, 0.8)
PASSES = (1, 2, 4, 8, 16)
#: RoundPipe's defaults (``ModelExecutePlan.auto``, ``RoundPipeRunConfig``)
DEFAULT_BALANCE = 1.1
DEFAULT_MEMORY_FRACTION = 0.6
DIMENSION_NAMES = (SWITCH, "rp.pool", "rp.balance", "rp.memory", "rp.grain", "rp.passes")


def pool_choices(node_classes: Sequence[NodeClass], cluster: ClusterSpec) -> dict[str, tuple[str, ...]]:
    """Pool name -> the node names it uses, for node classes of GPUs with a host link, fastest first."""
    out: dict[str, tuple[str, ...]] = {}
    classes = sorted(node_classes, key=lambda c: -c.peak_tflops * c.count)
    for c in classes:
        device = cluster.nodes[[n.name for n in cluster.nodes].index(c.node_names[0])].device
        if device.pcie_gen == 0:
            continue
        out[c.name] = c.node_names[:1]
        if len(c.node_names) > 1:
            out[f"{c.name}x{len(c.node_names)}"] = tuple(c.node_names)
    return out


def dimensions(node_classes: Sequence[NodeClass], cluster: ClusterSpec) -> list[Dimension]:
    """The roundpipe dimensions of a space of these node classes (none where no node qualifies)."""
    pools = pool_choices(node_classes, cluster)
    if not pools:
        return []
    return [
        Dimension(SWITCH, (False, True)),
        Dimension("rp.pool", tuple(pools)),
        Dimension("rp.balance", BALANCES, ordinal=True),
        Dimension("rp.memory", MEMORY_FRACTIONS, ordinal=True),
        Dimension("rp.grain", RECOMPUTE_GRAINS),
        Dimension("rp.passes", PASSES, ordinal=True),
    ]


def drop_if_off(dims: list[Dimension]) -> list[Dimension]:
    """``dims`` without the roundpipe dimensions when a restriction left the switch only ``False``: the
    space is then exactly the pipeline plans' (sampling draws what it drew before roundpipe existed)."""
    switch = next((d for d in dims if d.name == SWITCH), None)
    if switch is None or True in switch.choices:
        return dims
    return [d for d in dims if d.name not in DIMENSION_NAMES]


def off_params(dims: Mapping[str, Dimension]) -> dict[str, Any]:
    """The roundpipe dimensions' choices of a pipeline plan: the switch off, the rest at their first
    choice (they do not matter); empty where the space (its dimensions ``dims``) has no roundpipe dimensions."""
    if SWITCH not in dims:
        return {}
    # a search restricted to roundpipe plans keeps the switch on: params stay inside the dimensions' choices
    off = False if False in dims[SWITCH].choices else True
    return {name: (off if name == SWITCH else dims[name].choices[0]) for name in DIMENSION_NAMES}


def restriction(restrict: Mapping[str, Sequence[Any]], config: ParallelConfig) -> str | None:
    """Why ``config`` is outside a search restricted by ``restrict={"roundpipe": [...]}`` (``SearchSpace.check``):
    a roundpipe plan in a search of pipeline plans, or a pipeline plan (the dp start, an env edit) in a
    search of roundpipe plans; None otherwise."""
    allowed = restrict.get(SWITCH)
    if allowed is None:
        return None
    if config.is_roundpipe and True not in allowed:
        return "schedule: roundpipe plans are outside this search (restricted to roundpipe=False)"
    if not config.is_roundpipe and False not in allowed:
        return "schedule: this search is restricted to roundpipe plans (roundpipe=True)"
    return None


def decode(ctx: SpaceContext, params: Mapping[str, Any]) -> Decoded:
    """A roundpipe point of the space -> its plan (to be checked by ``SearchSpace.check``), or the reason
    there is none. The partition is cut with the datasheet cost model (RoundPipe measures; the space
    estimates)."""
    pools = pool_choices(ctx.node_classes, ctx.cluster)
    pool = params["rp.pool"]
    if pool not in pools:
        return Decoded(None, f"rp.pool {pool!r} is not a node class of GPUs here")
    mbs, passes = int(params["mbs"]), int(params["rp.passes"])
    gbs = ctx.model.global_batch_size
    nodes = pools[pool]
    if gbs % mbs:
        return Decoded(None, f"mbs={mbs} does not divide global_batch_size={gbs}")
    total = gbs // mbs
    if total % len(nodes):
        return Decoded(None, f"{total} micro-batches do not split evenly over {len(nodes)} pools")
    per_node = total // len(nodes)
    if per_node % passes:
        return Decoded(None, f"{per_node} micro-batches per pool do not split into rp.passes={passes} passes")
    node_of = {n.name: n for n in ctx.cluster.nodes}
    first = node_of[nodes[0]]
    smallest = first.device.memory_GiB
    limit = round(float(params["rp.memory"]) * smallest, 2)
    key = (pool, mbs, float(params["rp.balance"]), limit)
    cache = ctx.cache("roundpipe_partitions")
    part = cache.get(key)
    if part is None:
        part = auto_stages(ctx.costs, first.device_ids(), mbs, float(params["rp.balance"]), limit)
        cache[key] = part
    pipes = tuple(
        PipelineConfig(
            per_node,
            (),
            None,
            RoundPipeStages(
                node_of[n].device_ids(),
                part.forward_layers,
                part.backward_layers,
                part.fused_layers,
                str(params["rp.grain"]),
                limit,
                passes,
            ),
        )
        for n in nodes
    )
    try:
        return Decoded(ParallelConfig(mbs, pipes, ROUNDPIPE))
    except SpecError as e:
        return Decoded(None, str(e))


def start_params(ctx: SpaceContext) -> dict[str, Any] | None:
    """The point RoundPipe's defaults give (see the module docstring); None where RoundPipe does not apply.
    The pipeline dimensions take their first choices (they do not matter for a roundpipe plan). The
    caller decodes it (``SearchSpace.roundpipe_start``)."""
    pools = pool_choices(ctx.node_classes, ctx.cluster)
    dims = ctx.dims
    if not pools or SWITCH not in dims or True not in dims[SWITCH].choices:
        return None  # no roundpipe plans here, or the search is restricted to pipeline plans

    def pick(name: str, want: Any) -> Any:
        choices = dims[name].choices
        return want if want in choices else choices[0]

    pool = pick("rp.pool", next(iter(pools)))
    node = next(n for n in ctx.cluster.nodes if n.name == pools[pool][0])
    gbs = ctx.model.global_batch_size
    mbs_choices = dims["mbs"].choices
    enough = [m for m in mbs_choices if gbs // m >= node.count + 1]  # RoundPipe's default: GPUs + 1
    mbs = max(enough) if enough else min(mbs_choices)
    params = {d.name: d.choices[0] for d in dims.values()}
    params.update(
        {
            SWITCH: True,
            "rp.pool": pool,
            "rp.balance": pick("rp.balance", DEFAULT_BALANCE),
            "rp.memory": pick("rp.memory", DEFAULT_MEMORY_FRACTION),
            "rp.grain": pick("rp.grain", "stage"),
            "rp.passes": pick("rp.passes", 1),
            "mbs": mbs,
        }
    )
    return params


def params_of(config: ParallelConfig) -> dict[str, Any]:
    """Flat, MLflow-friendly parameters of a roundpipe plan (``SearchSpace.params_of``)."""
    rp = config.pipelines[0].roundpipe
    assert rp is not None
    return {
        "dp": len(config.pipelines),
        "pp": str(rp.num_stages),
        "tp": "1",
        "mbs": config.micro_batch_size,
        "schedule": config.schedule,
        "layers": f"F{'-'.join(map(str, rp.forward_layers))}|FB{rp.fused_layers}|B{'-'.join(map(str, rp.backward_layers))}",
        "microbatches": "-".join(str(p.num_microbatches) for p in config.pipelines),
        "recompute_stages": len(rp.backward_layers),
        "recompute_grain": rp.recompute_grain,
        "accumulation_steps": rp.accumulation_steps,
        "memory_limit_GiB": rp.memory_limit_GiB,
        "devices_used": len(config.devices),
    }
