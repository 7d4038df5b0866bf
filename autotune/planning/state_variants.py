"""The planner's memory-state variants: every ZeRO stage, offload mode, sequence parallelism and recomputation
choice over the pipelines the planner composed (issue 25).

The composition (``autotune.planning.planner``) decides the structure of a plan: tensor-parallel groups, the
pipelines they chain into, the layer split and the micro-batch shares, for one offload mode at a time. What a
stage keeps in device memory is a second choice on top of that structure, and it decides more than memory: on
8 RTX-3090 / RTX-4090 training Llama-2-7B the best plan is four 2-stage pipelines with ZeRO-3 and everything
offloaded (1.76x the best plan without offload); on 4 T4 + 4 L4 + 8 A10G with Llama-3-8B, ZeRO-2 with
sequence parallelism and no recomputation over dp's 5-stage pipelines beats every plan of the composition.

``variants(space, sim, structures, max_simulations)`` takes composed plans (``Candidate``s, best first) and,
per plan, every combination of

- ``zero``: each ZeRO stage of the space (only with data-parallel peers);
- ``offload``: the plan's own mode (the composition's, every stage) and the lighter ones;
- ``seq_parallel``: on and off where a stage has tensor parallelism and the space offers it;
- recomputation: the composition's choice, none at all where it recomputes, and Megatron's ``selective``
  and torchtitan's ``selective-op`` and ``every-2`` on every stage where the space has them;
- ``execution``: Zorse's layer-wise execution too, for plans of one-stage replicas with ZeRO-2/3 or offload
  (on a pipeline it serialises the stages);
- ``schedule``: Megatron-LM's interleaved 1F1B (two chunks per stage) where the layer split and the
  micro-batches allow it,

keeps those the memory model says fit (``Simulator.memory_estimate``, about 1 ms), times them with the
simulator itself (the traffic the composition leaves out: ZeRO gathers, offload copies) until
``max_simulations`` plans have been timed, and returns each structure's fastest variant as a ``Candidate``
whose estimate is the simulated iteration time and whose family names the choices, e.g.
``mixed+zero3+offload-all``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from autotune.planning.candidate import Candidate
from autotune.planning.space import SearchSpace
from autotune.planning.vocabulary import INTERLEAVED_CHUNKS, layerwise_pays
from autotune.specs import OFFLOAD_MODES, ParallelConfig
from autotune.specs.execution import LAYERWISE, MICROBATCH

INTERLEAVED = "interleaved-1f1b"
#: recomputation as the composition chose it, stage by stage
KEEP = "keep"
#: recomputation modes tried on every stage where the space has them
PARTIAL_RECOMPUTE = ("selective", "selective-op", "every-2")


@dataclass(frozen=True, slots=True)
class State:
    """One memory-state choice for a composed plan: ZeRO stage, offload mode (every stage), sequence
    parallelism, recomputation (``KEEP``: the composition's per stage; False; or a mode for every stage),
    execution and schedule."""

    zero: int
    offload: str
    sequence_parallel: bool
    recompute: bool | str
    execution: str = MICROBATCH
    schedule: str = ""  # "": the plan's own


def choices(space: SearchSpace, config: ParallelConfig, sharding: bool = True) -> Iterator[State]:
    """Every memory-state choice for ``config`` the space has, the plan's own first; layer-wise execution
    only for plans of one-stage replicas (it serialises a pipeline's stages, RESULTS.md "Layer-wise
    execution"), Megatron's interleaved schedule only for pipelines whose stages hold an even number of
    layers and whose micro-batches divide by their depth; with ``sharding`` False, only the plan's own ZeRO
    stage and offload."""
    dims = space._dims
    peers = len(config.pipelines) > 1 or any(s.mixed for p in config.pipelines for s in p.stages)
    zeros = [config.zero] + [z for z in dims["zero"].choices if sharding and peers and z != config.zero]
    heaviest = max(OFFLOAD_MODES.index(s.offload) for p in config.pipelines for s in p.stages)
    lighter = [o for o in dims["offload"].choices if sharding and OFFLOAD_MODES.index(o) < heaviest]
    offloads = [OFFLOAD_MODES[heaviest]] + lighter
    tp = any(s.tp > 1 for p in config.pipelines for s in p.stages)
    sps = (False, True) if tp and "seq_parallel" in dims else (False,)
    # the composition's recomputation (KEEP), none where it recomputes, and the partial modes of the space
    # (Megatron's selective, torchtitan's selective-op and every-2) on every stage
    partial = [m for m in dims["recompute"].choices if m in PARTIAL_RECOMPUTE]
    rcs = [KEEP] + ([False] if any(s.recompute for p in config.pipelines for s in p.stages) else []) + partial
    one_stage = all(len(p.stages) == 1 for p in config.pipelines)
    layerwise = one_stage and "execution" in dims and LAYERWISE in dims["execution"].choices
    executions = (MICROBATCH, LAYERWISE) if layerwise else (MICROBATCH,)
    interleaves = (
        not one_stage
        and not config.has_mixed_stages  # Megatron's chunks over stages of one rank only (specs.mixed_stage)
        and INTERLEAVED in dims["schedule"].choices
        and config.schedule != INTERLEAVED
        and all(
            p.num_microbatches % len(p.stages) == 0 and all(s.layers % INTERLEAVED_CHUNKS == 0 for s in p.stages)
            for p in config.pipelines
        )
    )
    schedules = ("", INTERLEAVED) if interleaves else ("",)
    for z, o, sp, rc, ex, sched in itertools.product(zeros, offloads, sps, rcs, executions, schedules):
        if ex == MICROBATCH or layerwise_pays((z,), (o,)):
            yield State(z, o, sp, rc, ex, sched)


def apply(config: ParallelConfig, state: State) -> ParallelConfig:
    """``config`` with the memory-state choice ``state``."""
    pipes = tuple(
        replace(
            p,
            stages=tuple(
                replace(
                    s,
                    offload=state.offload,
                    sequence_parallel=state.sequence_parallel and s.tp > 1,
                    recompute=s.recompute if state.recompute == KEEP else state.recompute,
                )
                for s in p.stages
            ),
            execution=state.execution,
        )
        for p in config.pipelines
    )
    out = replace(config, pipelines=pipes, zero=state.zero)
    if state.schedule == INTERLEAVED:
        out = replace(out, schedule=INTERLEAVED, virtual_stages=INTERLEAVED_CHUNKS)
    return out


def label(family: str, config: ParallelConfig, base: ParallelConfig) -> str:
    """``family`` with the variant's memory-state choices, e.g. ``mixed+zero3+offload-all+sp``."""
    parts = [family] + ([f"zero{config.zero}"] if config.zero else [])
    parts += [f"offload-{o}" for o in sorted({s.offload for p in config.pipelines for s in p.stages}) if o != "none"]
    if any(s.sequence_parallel for p in config.pipelines for s in p.stages):
        parts.append("sp")
    if any(s.recompute for p in base.pipelines for s in p.stages) and not any(
        s.recompute for p in config.pipelines for s in p.stages
    ):
        parts.append("no-recompute")
    modes = {s.recompute for p in config.pipelines for s in p.stages}
    if len(modes) == 1 and next(iter(modes)) in PARTIAL_RECOMPUTE:
        parts.append(f"recompute-{next(iter(modes))}")
    if config.pipelines[0].execution == LAYERWISE:
        parts.append("layerwise")
    if config.schedule == INTERLEAVED and base.schedule != INTERLEAVED:
        parts.append("interleaved")
    return "+".join(parts)


def variants(
    space: SearchSpace, sim, structures: Sequence[Candidate], max_simulations: int, sharding: bool = True
) -> list[Candidate]:
    """Each structure's fastest memory-state variant that fits (module docstring), timed by ``sim`` (a
    ``Simulator``: ``memory_estimate``, ``evaluate``), at most ``max_simulations`` plans timed in all: first
    every structure's variants with the composition's recomputation or none, then those with the partial
    modes or the interleaved schedule (so that the cap leaves no structure untried for them). ``sharding=False`` keeps each structure's
    ZeRO stage and offload (plans that come with the best of them: ``sharded_dp``)."""
    best: dict[int, Candidate] = {}
    timed, seen = 0, set()
    for partial in (False, True):
        for i, cand in enumerate(structures):
            for state in choices(space, cand.config, sharding):
                if (state.recompute in PARTIAL_RECOMPUTE or state.schedule == INTERLEAVED) != partial:
                    continue
                if timed >= max_simulations:
                    break
                config = apply(cand.config, state)
                if config in seen or space.check(config) is not None:
                    continue
                seen.add(config)
                memory = sim.memory_estimate(config)
                if memory is None or not memory.ok:
                    continue
                m = sim.evaluate(config)
                timed += 1
                if m.ok and (i not in best or m.iteration_time_s < best[i].estimate_s):
                    best[i] = Candidate(config, m.iteration_time_s, label(cand.family, config, cand.config))
    return [best[i] for i in sorted(best)]
