"""The planner's family ``sharded-dp``: DeepSpeed-style ZeRO data parallelism, every tensor-parallel group
one replica of the whole model, timed by the simulator itself (a one-stage replica has no pipeline to
compose)."""

from __future__ import annotations

from collections.abc import Sequence

from autotune.planning.candidate import Candidate
from autotune.planning.space import SearchSpace
from autotune.planning.vocabulary import apportion
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig


def candidates(space: SearchSpace, sim, kinds: Sequence[tuple[str, int, tuple, float]]) -> list[Candidate]:
    """Family ``sharded-dp`` (DeepSpeed's ZeRO data parallelism): every tensor-parallel group of the
    cluster one replica of the whole model, micro-batches in proportion to the group's speed, the
    state sharded (ZeRO 1-3) and offloaded as little as lets it fit. The other families compose ZeRO
    only with offload and offload only when nothing fits without it, so this plan was outside them
    (a homogeneous L4 cluster's best plan for Llama-2-7B). At the smallest micro-batch size, per tp
    degree where its most frugal plan fits: every zero stage and offload choice that the memory
    model says fits without recomputation, timed by the simulator (one stage per
    replica: no pipeline to compose); the fastest is the degree's candidate (neither less offload
    nor less sharding is always faster: on 32 L4 with Llama-2-7B, ZeRO-2 with everything offloaded
    beats ZeRO-1 with everything offloaded and ZeRO-3 with the optimizer offloaded).

    ``sim``: the simulator that times them (``evaluate``, ``memory_estimate``); ``kinds``: the planner's group
    kinds as (node class, tp degree, its groups, their speed)."""
    dims = space._dims
    zeros = [z for z in (1, 2, 3) if z in dims["zero"].choices]
    offloads = [o for o in ("none", "optimizer", "all") if o in dims["offload"].choices]
    if not zeros:
        return []
    out = []
    for mbs in sorted(dims["mbs"].choices)[:1]:
        total = space.model.global_batch_size // mbs
        for tp in (1, 2, 4, 8):
            groups = []
            for node_class, degree, kind_groups, speed in kinds:
                allowed = [k[1] for k in kinds if k[0] == node_class and k[1] <= tp]
                if allowed and degree == max(allowed):
                    groups += [(g, speed) for g in kind_groups]
            if len(groups) < 2 or len(groups) > total or (tp > 1 and all(len(g) < tp for g, _ in groups)):
                continue
            shares = apportion(total, [v for _, v in groups])
            if _fitting(space, sim, mbs, groups, shares, zeros[-1], offloads[-1]) is None:
                continue  # not even the most frugal of them fits
            best = None
            for zero in zeros:
                for offload in offloads:
                    config = _fitting(space, sim, mbs, groups, shares, zero, offload)
                    m = sim.evaluate(config) if config is not None else None
                    if m is not None and m.ok and (best is None or m.iteration_time_s < best.estimate_s):
                        best = Candidate(config, m.iteration_time_s, "sharded-dp")
            if best is not None:
                out.append(best)
    return out


def _fitting(space: SearchSpace, sim, mbs, groups, shares, zero, offload) -> ParallelConfig | None:
    """The sharded plan (no recomputation: with it, Llama-2-70B fits as 1,024 replicas, and timing
    those plans took 8 CPU s of the planner for plans 1.8x slower than its pipelines) when it is
    valid and the memory model says it fits, else None."""
    pipes = tuple(
        PipelineConfig(n, (StageConfig(g, space.model.num_layers, False, offload),))
        for (g, _), n in zip(groups, shares)
    )
    config = ParallelConfig(mbs, pipes, "1f1b", zero=zero)
    if space.check(config) is not None:
        return None
    m = sim.memory_estimate(config)
    return config if m is not None and m.ok else None
