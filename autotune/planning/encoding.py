"""Every plan as a point of the shared search space (issue 25), so that a method starting from another
method's plan moves from that plan.

A plan the structured planner composes (or a user's file) rarely decodes from the space's dimensions alone:
its layer split, micro-batch shares and per-stage recomputation are the planner's, not the split exponents'.
``nearest(ctx, config)`` gives the point of the space closest to it: every dimension at the plan's own choice
where it has one (tp per node class, the classes used, pipeline depth, stage order, micro-batch size,
schedule, recomputation, sequence parallelism, ZeRO, offload, execution, the MoE choices, mixed-stage width),
the split exponents at 1.0. ``SearchSpace.encode(config)`` adds ``ANCHOR``: a short key of the plan itself,
which the space keeps beside that point. Decoding an anchored point:

- unchanged: the plan itself;
- with *state* dimensions moved (``STATE_DIMENSIONS``: micro-batch size, schedule, recomputation, sequence
  parallelism, ZeRO, offload, execution, sync period): the same plan with exactly those choices changed
  (``apply_state``: micro-batches rescaled in proportion to the plan's own shares, recomputation as the
  decoder sets it, ZeRO only with data-parallel peers, layer-wise execution only where it differs);
- with a *structural* dimension moved (tp, use, pp, assign, order, the splits, the MoE grouping, stage
  ranks, RoundPipe's knobs): the anchor no longer applies and the point decodes as any other.

An anchor key the space does not know (a resumed search whose planner has not run yet) decodes as the
point alone.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from autotune.planning import mixed_space, roundpipe_space
from autotune.planning.vocabulary import (
    INTERLEAVED_CHUNKS,
    Params,
    SpaceContext,
    apportion,
    layerwise_pays,
    same_choice,
    stage_recompute,
)
from autotune.specs import OFFLOAD_MODES, SCHEDULES, ParallelConfig
from autotune.specs.execution import MICROBATCH

#: the param that names an anchored plan (``SearchSpace.encode``)
ANCHOR = "plan"
#: dimensions an anchored plan can change without losing its structure
STATE_DIMENSIONS = ("mbs", "schedule", "recompute", "seq_parallel", "zero", "offload", "execution", "sync_every")


def key_of(config: ParallelConfig) -> str:
    """A short, stable key of a plan (its JSON's hash)."""
    return hashlib.sha1(config.to_json(indent=None).encode()).hexdigest()[:12]


def _pick(ctx: SpaceContext, name: str, want: Any) -> Any:
    """``want`` where the dimension has it, else the nearest ordinal choice, else the first choice."""
    dim = ctx.dims[name]
    for c in dim.choices:
        if same_choice(c, want):
            return c
    if dim.ordinal and isinstance(want, int | float) and all(isinstance(c, int | float) for c in dim.choices):
        return min(dim.choices, key=lambda c: abs(float(c) - float(want)))
    return dim.choices[0]


def recompute_label(config: ParallelConfig) -> str:
    """The space's recompute choice that describes the plan's stages (``low-memory`` for a mix of on and off)."""
    flags = {s.recompute for p in config.pipelines for s in p.stages}
    if len(flags) == 1:
        flag = flags.pop()
        return flag if isinstance(flag, str) else ("all" if flag else "none")
    return "low-memory" if flags <= {True, False} else "all"


def nearest(ctx: SpaceContext, config: ParallelConfig) -> Params:
    """The point of the space closest to ``config`` (module docstring), without an anchor."""
    dims = ctx.dims
    out: Params = {}
    if config.is_roundpipe:
        out[roundpipe_space.SWITCH] = True
        out["mbs"] = _pick(ctx, "mbs", config.micro_batch_size)
    else:
        class_of = {n: c.name for c in ctx.node_classes for n in c.node_names}
        tps: dict[str, Counter] = {c.name: Counter() for c in ctx.node_classes}
        for p in config.pipelines:
            for s in p.stages:
                for r in s.ranks_of(p.num_microbatches):
                    tps[class_of[ctx.cluster.node_of(r.devices[0]).name]][r.tp] += 1
        for c in ctx.node_classes:
            if tps[c.name]:
                out[f"tp.{c.name}"] = _pick(ctx, f"tp.{c.name}", tps[c.name].most_common(1)[0][0])
            if f"use.{c.name}" in dims:
                out[f"use.{c.name}"] = _pick(ctx, f"use.{c.name}", bool(tps[c.name]))
        stages = config.pipelines[0].stages
        speed = [ctx.cluster.device(s.devices[0]).peak_tflops * s.tp for s in stages]
        several = any(
            len({class_of[ctx.cluster.node_of(s.devices[0]).name] for s in p.stages}) > 1 for p in config.pipelines
        )
        widest = max(len(s.ranks) if s.ranks else 1 for p in config.pipelines for s in p.stages)
        out.update(
            pp=_pick(ctx, "pp", len(stages)),
            assign=_pick(ctx, "assign", "mixed" if several else "grouped"),
            order=_pick(ctx, "order", "slow-first" if speed[0] < speed[-1] else "fast-first"),
            layer_split=_pick(ctx, "layer_split", 1.0),
            batch_split=_pick(ctx, "batch_split", 1.0),
            mbs=_pick(ctx, "mbs", config.micro_batch_size),
            schedule=_pick(ctx, "schedule", config.schedule),
            recompute=_pick(ctx, "recompute", recompute_label(config)),
        )
        if "seq_parallel" in dims:
            out["seq_parallel"] = _pick(
                ctx, "seq_parallel", any(s.sequence_parallel for p in config.pipelines for s in p.stages)
            )
        offload = max((s.offload for p in config.pipelines for s in p.stages), key=OFFLOAD_MODES.index)
        out.update(zero=_pick(ctx, "zero", config.zero), offload=_pick(ctx, "offload", offload))
        if "execution" in dims:
            out["execution"] = _pick(ctx, "execution", config.pipelines[0].execution)
        if "expert_parallel" in dims:
            trains = "all" if all(p.trains_experts is None for p in config.pipelines) else "partition"
            out.update(
                expert_parallel=_pick(ctx, "expert_parallel", config.expert_parallel),
                trains_experts=_pick(ctx, "trains_experts", trains),
                sync_every=_pick(ctx, "sync_every", config.sync_every_steps),
            )
        if "stage_ranks" in dims:  # stages of unequal or unlisted widths: Zorse's bandwidth cut
            widths = {len(s.ranks) or 1 for p in config.pipelines for s in p.stages}
            listed = len(widths) == 1 and widest in dims["stage_ranks"].choices
            cut = mixed_space.BANDWIDTH if mixed_space.BANDWIDTH in dims["stage_ranks"].choices else widest
            out["stage_ranks"] = _pick(ctx, "stage_ranks", widest if listed else cut)
        out.update(roundpipe_space.off_params(dims))
    for name, dim in dims.items():  # anything else (RoundPipe's knobs of a pipeline plan): its first choice
        out.setdefault(name, dim.choices[0])
    return {name: out[name] for name in dims}


def base_points(ctx: SpaceContext, configs, limit: int) -> list[Params]:
    """The points (``nearest``) of the first ``limit`` of ``configs`` (best first) that differ in their
    tensor-parallel degrees, the node classes they use or their micro-batch size; RoundPipe plans skipped.
    The planner's families that decode plans around its best ones start from these."""
    points, keys = [], set()
    for config in configs:
        if config.is_roundpipe:
            continue
        point = nearest(ctx, config)
        key = tuple(sorted((k, str(v)) for k, v in point.items() if k.startswith(("tp.", "use.")) or k == "mbs"))
        if key not in keys:
            keys.add(key)
            points.append(point)
        if len(points) >= limit:
            break
    return points


def decode_anchored(
    ctx: SpaceContext, config: ParallelConfig, point: Mapping[str, Any], params: Mapping[str, Any]
) -> ParallelConfig | str | None:
    """``params`` decoded from the anchored plan ``config`` (encoded as ``point``): the plan with the state
    choices that differ applied, a reason when they cannot be, or None when a structural choice differs."""
    for name, value in point.items():
        if name not in STATE_DIMENSIONS and not same_choice(value, params.get(name, value)):
            return None
    changed = {
        n: params[n] for n in STATE_DIMENSIONS if n in point and n in params and not same_choice(point[n], params[n])
    }
    if not changed:
        return config
    if config.is_roundpipe:
        return None
    return apply_state(ctx, config, changed)


def apply_state(ctx: SpaceContext, config: ParallelConfig, changed: Mapping[str, Any]) -> ParallelConfig | str:
    """``config`` with the state choices ``changed`` (dimension name -> choice), as the decoder sets them."""
    pipes = list(config.pipelines)
    if "mbs" in changed:
        mbs = int(changed["mbs"])
        gbs = ctx.model.global_batch_size
        if gbs % mbs:
            return f"mbs={mbs} does not divide global_batch_size={gbs}"
        counts = apportion(gbs // mbs, [p.num_microbatches for p in pipes])
        rescaled = [mixed_space.rescale_shares(p, c) for p, c in zip(pipes, counts or [])]
        if counts is None or any(p is None for p in rescaled):
            return f"{gbs // mbs} micro-batches of {mbs} cannot feed the plan's {len(pipes)} replicas and ranks"
        pipes = rescaled
        config = replace(config, micro_batch_size=mbs)
    if "schedule" in changed:
        schedule = str(changed["schedule"])
        virtual = INTERLEAVED_CHUNKS if schedule == "interleaved-1f1b" else 1
        config = replace(config, schedule=schedule, virtual_stages=virtual)
    stage_changes: dict[str, Any] = {}
    if "recompute" in changed:
        mode = str(changed["recompute"])
        memory = {d: ctx.cluster.device(d).memory_GiB for p in pipes for d in p.devices}
        max_mem = max(memory.values())

        def flag(stage) -> bool | str:
            return stage_recompute(mode, min(memory[d] for d in stage.devices), max_mem)

        pipes = [replace(p, stages=tuple(replace(s, recompute=flag(s)) for s in p.stages)) for p in pipes]
    if "seq_parallel" in changed:
        stage_changes["sp"] = bool(changed["seq_parallel"])
    if "offload" in changed:
        stage_changes["offload"] = str(changed["offload"])
    if stage_changes:
        pipes = [
            replace(
                p,
                stages=tuple(
                    replace(
                        s,
                        offload=stage_changes.get("offload", s.offload),
                        sequence_parallel=stage_changes["sp"] and s.tp > 1
                        if "sp" in stage_changes
                        else s.sequence_parallel,
                    )
                    for s in p.stages
                ),
            )
            for p in pipes
        ]
    zero = config.zero
    if "zero" in changed:
        peers = len(pipes) > 1 or any(s.mixed for p in pipes for s in p.stages)
        zero = int(changed["zero"]) if peers else 0
    offloads = [s.offload for p in pipes for s in p.stages]
    execution = str(changed.get("execution", pipes[0].execution))
    if not layerwise_pays((zero,), offloads):
        execution = MICROBATCH
    pipes = [replace(p, execution=execution) for p in pipes]
    sync = int(changed.get("sync_every", config.sync_every_steps))
    return replace(config, pipelines=tuple(pipes), zero=zero, sync_every_steps=sync)


def sync_params(params: Params, config: ParallelConfig) -> None:
    """Keep a plan's encoding in step with fine edits: its micro-batch size and (pipeline plans) schedule."""
    params["mbs"] = config.micro_batch_size
    if config.schedule in SCHEDULES:
        params["schedule"] = config.schedule
