"""The most memory-frugal plan of a search space: the start plan every method includes (memory first).

On a cluster where little fits, a search that starts from fast plans may spend its budget on plans
that do not run. Every method's start plans therefore include the plan of the space that needs the
least device memory: every node class used at its widest tensor-parallel degree, micro-batch 1,
recomputation everywhere, schedule 1F1B, the largest ZeRO stage and offload mode where the space has
them, and, among pipeline depths, stage orders, device assignments and layer splits, the one whose
fullest device is least full by the memory model (``Simulator.memory_estimate``: usually the deepest
pipeline, which spreads the weights over the most stages; with ZeRO-3 and offload, where the state
leaves the devices, often a shallower one with fewer micro-batches in flight).

``frugal_params(space, simulator)`` returns its encoding (or None when the space has no valid plan);
the memory model is the search's own (the simulator behind the evaluator, with its profile, or the
corrected one of ``--backend real``), so "frugal" means what the screen will judge. Where each method
puts it: ``optuna`` enqueues it after its speed-proportional warm start, ``rl`` tries it after its
start plans, ``random`` and ``dp`` evaluate it when nothing they evaluated runs and one evaluation is
left (``fallback_due``); ``uniform`` and ``exhaustive`` keep their grids.

``memory_repairs`` gives the steps from a plan that does not fit toward it (Optuna repairs the
proposals the memory model screens out, see ``autotune.search.agents.tpe``).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from autotune.planning.space import Params, SearchSpace

log = logging.getLogger(__name__)


def _widest(space: SearchSpace, name: str) -> Any:
    return space._dims[name].choices[-1]


#: plans of one ZeRO / offload / tensor-parallel setting refused in a row before ``frugal_params`` tries the next
_REFUSED_BEFORE_NEXT = 16


def frugal_candidates(space: SearchSpace) -> list[Params]:
    """Encodings of the memory-frugal plans: widest tp, every class used, mbs 1, recompute all, 1F1B,
    ZeRO and offload at their largest, for every pipeline depth (deepest first), assignment, order
    and layer split (even or speed-proportional)."""
    dims = space._dims
    base: Params = {f"tp.{c.name}": _widest(space, f"tp.{c.name}") for c in space.node_classes}
    for c in space.node_classes:
        name = f"use.{c.name}"
        if name in dims:
            base[name] = True if True in dims[name].choices else dims[name].choices[0]
    base["mbs"] = dims["mbs"].choices[0]
    base["schedule"] = "1f1b" if "1f1b" in dims["schedule"].choices else dims["schedule"].choices[0]
    base["recompute"] = "all" if "all" in dims["recompute"].choices else dims["recompute"].choices[-1]
    base["batch_split"] = dims["batch_split"].choices[-1]
    for name in ("zero", "offload", "seq_parallel"):  # memory-saving dimensions, ordered least to most saving
        if name in dims:
            base[name] = dims[name].choices[-1]
    from autotune.planning import roundpipe_space

    base.update(roundpipe_space.off_params(space._dims))  # pipeline plans: an enqueued trial must not draw the switch
    # MoE: every replica trains every expert, synchronised every step; expert parallelism, which spreads the
    # experts, at every degree (largest first: the fewest experts per device)
    if "trains_experts" in dims:
        base["trains_experts"] = "all" if "all" in dims["trains_experts"].choices else dims["trains_experts"].choices[0]
    if "sync_every" in dims:
        base["sync_every"] = dims["sync_every"].choices[0]
    eps = list(reversed(dims["expert_parallel"].choices)) if "expert_parallel" in dims else [None]
    out = []
    splits = sorted(set(dims["layer_split"].choices) & {0.0, 1.0}) or list(dims["layer_split"].choices[:1])
    for pp, ep, assign, order, split in itertools.product(
        reversed(dims["pp"].choices), eps, dims["assign"].choices, dims["order"].choices, splits
    ):
        point = dict(base, pp=pp, assign=assign, order=order, layer_split=split)
        if ep is not None:
            point["expert_parallel"] = ep
        out.append(point)
    return out


def frugal_params(space: SearchSpace, simulator, refusal=None) -> Params | None:
    """The candidate whose fullest device (or host) is least full by ``simulator``'s memory model, among
    those ``refusal`` (the search's: e.g. plans `autotune train` does not run) does not refuse: where the
    largest ZeRO stage and offload mode are refused, the next smaller ones, in turn."""
    dims = space._dims
    zeros = list(reversed(dims["zero"].choices)) if "zero" in dims else [None]
    offloads = list(reversed(dims["offload"].choices)) if "offload" in dims else [None]
    tps = [f"tp.{c.name}" for c in space.node_classes if f"tp.{c.name}" in dims]
    widths = sorted({t for name in tps for t in dims[name].choices}, reverse=True) or [None]
    candidates = frugal_candidates(space)
    for width, zero, offload in itertools.product(widths, zeros, offloads):
        best: tuple[float, int, Params] | None = None
        refused = 0  # the first plans of a setting all refused: the setting is (ZeRO or tp with MoE, say)
        for k, params in enumerate(candidates):
            if refused >= _REFUSED_BEFORE_NEXT and best is None:
                break
            relaxed = {"zero": zero, "offload": offload}
            if width is not None:  # every class at most this wide (MoE plans the runner runs have no tp)
                relaxed.update({name: max(t for t in dims[name].choices if t <= width) for name in tps})
                relaxed.update({name: min(dims[name].choices) for name in tps if width < min(dims[name].choices)})
            params = dict(params, **{k2: v for k2, v in relaxed.items() if v is not None})
            decoded = space.decode(params)
            if not decoded.ok:
                continue
            if refusal is not None and refusal(decoded.config) is not None:
                refused += 1
                continue
            m = simulator.memory_estimate(decoded.config)
            if m is None:
                continue
            use = simulator.memory_use(m)
            if best is None or use < best[0] - 1e-12:
                best = (use, k, params)
        if best is not None:
            log.debug("memory-frugal plan: fullest device at %.2f of its usable memory", best[0])
            return best[2]
        if refusal is None:
            return None
    return None


def search_simulator(space: SearchSpace, evaluator=None):
    """The memory model a search judges plans with: the simulator behind ``evaluator`` (its profile,
    or the corrected one of ``--backend real``), else the datasheet simulator of the space."""
    from autotune.planning.planner import simulator_of

    sim = simulator_of(evaluator)
    if sim is None:
        from autotune.simulator import Simulator

        sim = Simulator(space.cluster, space.model)
    return sim


def fallback_due(evaluator) -> bool:
    """True when no evaluated plan runs yet and the search can make one more evaluation at most (its
    budget's last, or the last plan before the screened-out cap): the moment for the frugal plan."""
    best = evaluator.best
    if best is not None and best.measurement.ok:
        return False
    return evaluator.remaining <= 1 or len(evaluator.screened) >= evaluator.max_screened - 1


def frugal_start(space: SearchSpace, evaluator=None) -> Params | None:
    """``frugal_params`` with the search's memory model (see ``search_simulator``)."""
    try:
        return frugal_params(space, search_simulator(space, evaluator), getattr(evaluator, "refusal", None))
    except Exception as e:  # a start plan is a help, never a reason for a search to fail
        log.warning("no memory-frugal start plan: %s", e)
        return None


def memory_repairs(space: SearchSpace, params: Params):
    """Encodings that need less memory than ``params``, each one step further than the last:
    recomputation everywhere, then micro-batch size 1, the largest ZeRO stage, the largest offload
    mode, then every class one tensor-parallel degree wider and the pipeline one depth deeper (or, where
    the wider groups leave too few ranks for that depth, the deepest that decodes), until both are at
    their largest. Used to repair a plan the memory model screened out (``run_optuna``)."""
    dims = space._dims
    cur = dict(params)

    def moved(name: str, to_end: bool = False, up: bool = True) -> bool:
        dim = dims.get(name)
        if dim is None or cur.get(name) not in dim.choices:
            return False
        i = dim.choices.index(cur[name])
        j = (len(dim.choices) - 1 if up else 0) if to_end else i + (1 if up else -1)
        if j == i or not 0 <= j < len(dim.choices):
            return False
        cur[name] = dim.choices[j]
        return True

    if "all" in dims["recompute"].choices and cur.get("recompute") != "all":
        cur["recompute"] = "all"
        yield dict(cur)
    if moved("mbs", to_end=True, up=False):
        yield dict(cur)
    for name in ("zero", "offload", "seq_parallel"):  # memory-saving dimensions, ordered least to most saving
        if moved(name, to_end=True):
            yield dict(cur)
    pp = dims.get("pp")
    while True:
        wider = [moved(f"tp.{c.name}") for c in space.node_classes]
        deeper = moved("pp")
        if not any(wider) and not deeper:
            return
        if pp is not None and not space.decode(cur).ok:
            if not any(wider):  # only deeper, and that does not decode: nothing further saves memory
                return
            # wider tensor parallelism leaves fewer ranks for the stages: the deepest pipeline that decodes
            fits = [d for d in reversed(pp.choices) if space.decode({**cur, "pp": d}).ok]
            if fits:
                cur["pp"] = fits[0]
        yield dict(cur)
