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
- recomputation: the composition's choice, and none at all where it recomputes;
- ``execution``: Zorse's layer-wise execution too, for plans of one-stage replicas with ZeRO-2/3 or offload
  (on a pipeline it serialises the stages),

keeps those the memory model says fit (``Simulator.memory_estimate``, about 1 ms), times them with the
simulator itself (the traffic the composition leaves out: ZeRO gathers, offload copies) until
``max_simulations`` plans have been timed, and returns each structure's fastest variant as a ``Candidate``
whose estimate is the simulated iteration time and whose family names the choices, e.g.
``mixed+zero3+offload-all``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace

from autotune.planning.candidate import Candidate
from autotune.planning.space import SearchSpace
from autotune.planning.vocabulary import layerwise_pays
from autotune.specs import OFFLOAD_MODES, ParallelConfig
from autotune.specs.execution import LAYERWISE, MICROBATCH


def choices(space: SearchSpace, config: ParallelConfig) -> Iterator[tuple[int, str, bool, bool, str]]:
    """(zero, offload, sequence parallelism, keep the composition's recomputation, execution) of every
    variant of ``config`` the space has, the plan's own choices first; layer-wise execution only for plans
    of one-stage replicas (it serialises a pipeline's stages, RESULTS.md "Layer-wise execution")."""
    dims = space._dims
    peers = len(config.pipelines) > 1 or any(s.mixed for p in config.pipelines for s in p.stages)
    zeros = [config.zero] + [z for z in dims["zero"].choices if peers and z != config.zero]
    heaviest = max(OFFLOAD_MODES.index(s.offload) for p in config.pipelines for s in p.stages)
    offloads = [OFFLOAD_MODES[heaviest]] + [o for o in dims["offload"].choices if OFFLOAD_MODES.index(o) < heaviest]
    tp = any(s.tp > 1 for p in config.pipelines for s in p.stages)
    sps = (False, True) if tp and "seq_parallel" in dims else (False,)
    rcs = (True, False) if any(s.recompute for p in config.pipelines for s in p.stages) else (True,)
    one_stage = all(len(p.stages) == 1 for p in config.pipelines)
    layerwise = one_stage and "execution" in dims and LAYERWISE in dims["execution"].choices
    executions = (MICROBATCH, LAYERWISE) if layerwise else (MICROBATCH,)
    for z, o, sp, rc, ex in itertools.product(zeros, offloads, sps, rcs, executions):
        if ex == MICROBATCH or layerwise_pays((z,), (o,)):
            yield z, o, sp, rc, ex


def apply(
    config: ParallelConfig, zero: int, offload: str, sp: bool, keep_recompute: bool, execution: str = MICROBATCH
) -> ParallelConfig:
    """``config`` with these memory-state choices (``offload`` for every stage)."""
    pipes = tuple(
        replace(
            p,
            stages=tuple(
                replace(
                    s,
                    offload=offload,
                    sequence_parallel=sp and s.tp > 1,
                    recompute=s.recompute if keep_recompute else False,
                )
                for s in p.stages
            ),
            execution=execution,
        )
        for p in config.pipelines
    )
    return replace(config, pipelines=pipes, zero=zero)


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
    if config.pipelines[0].execution == LAYERWISE:
        parts.append("layerwise")
    return "+".join(parts)


def variants(space: SearchSpace, sim, structures: Sequence[Candidate], max_simulations: int) -> list[Candidate]:
    """Each structure's fastest memory-state variant that fits (module docstring), timed by ``sim`` (a
    ``Simulator``: ``memory_estimate``, ``evaluate``), at most ``max_simulations`` plans timed in all."""
    out, timed, seen = [], 0, set()
    for cand in structures:
        best: Candidate | None = None
        for z, o, sp, rc, ex in choices(space, cand.config):
            if timed >= max_simulations:
                break
            config = apply(cand.config, z, o, sp, rc, ex)
            if config in seen or space.check(config) is not None:
                continue
            seen.add(config)
            memory = sim.memory_estimate(config)
            if memory is None or not memory.ok:
                continue
            m = sim.evaluate(config)
            timed += 1
            if m.ok and (best is None or m.iteration_time_s < best.estimate_s):
                best = Candidate(config, m.iteration_time_s, label(cand.family, config, cand.config))
        if best is not None:
            out.append(best)
        if timed >= max_simulations:
            break
    return out
