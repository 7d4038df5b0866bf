"""``autotune/ParallelConfig-v0``: edit a parallel plan one move at a time; reward = throughput gain.

State: the current plan (its ``SearchSpace`` encoding plus the fine edits made since) and its last
``Measurement``. Each step applies one move, evaluates the new plan through the evaluator (simulator
or a short profiled run; cached, so a revisited plan costs nothing) and rewards

    reward = clip((tokens_per_s_new - tokens_per_s_prev) / tokens_per_s_prev, -1, 1)

A plan that does not run (OOM, failed, timed out) gives ``FAIL_PENALTY`` and the env stays on the
previous plan; a masked (invalid) action gives ``INVALID_PENALTY`` and changes nothing; ``info``
says which. Nothing raises. Episodes never terminate (there is no goal state) and are truncated
after ``max_steps`` steps, or when a ``BudgetedEvaluator`` backend has no budget left for a new plan.
Each reset starts from the speed-proportional plans (``SearchSpace.heuristic_params``, the first that
runs), from random plans too with ``random_start``, or, with ``start_from_best`` and a
``BudgetedEvaluator`` backend, from the best plan the search has found so far.

Moves (a fixed list, the same on every cluster; see ``ACTIONS``):
  - ``layer k>``/``layer k<``: move one layer (two with interleaving) across the boundary between
    stage k and k+1, in every pipeline that has that boundary;
  - ``recompute k``: toggle activation recomputation on stage k of every pipeline;
  - ``batch r-``/``batch r+``: move one micro-batch from replica r to the least loaded replica, or to
    replica r from the most loaded one (load = micro-batches / nominal replica speed);
  - ``mbs+``/``mbs-``: next larger/smaller micro-batch size (micro-batches rescaled);
  - ``schedule <s>``: switch pipeline schedule;
  - ``<dim>+``/``<dim>-`` for the space's structure dimensions (pp, tp of node class c, use of node
    class c, assign, order, layer_split, batch_split, recompute): re-decode the plan with that
    choice moved one step (this resets the fine edits).
  - ``noop``: valid only when no other move is, so the mask is never all False.
  - appended after the fixed list: ``zero+``/``zero-`` and ``offload+``/``offload-`` (``ZERO_ACTIONS``,
    re-decode) on every space that has those dimensions (issue 9).
  - MoE models only, appended after those (``MOE_ACTIONS``): ``<dim>+``/``<dim>-`` for
    ``expert_parallel``, ``trains_experts`` and ``sync_every`` (re-decode, as the structure moves).
  - With ``actions_for(space, mixed=True)`` (the from-scratch RL search) and a space with mixed-stage
    dimensions (several node classes), appended last (``MIXED_ACTIONS``):
    ``stage_ranks+``/``stage_ranks-`` (re-decode), and ``share k+``/``share k-``: move one
    micro-batch between two ranks of stage k of every pipeline where it has several (``+`` from the rank
    with the most micro-batches per speed to the one with the least, ``-`` the other way). Moves that
    change a pipeline's micro-batches (``batch``, ``mbs``) rescale its stages' shares.

Observations are fixed-size and normalised, independent of the cluster size: per stage slot (up to
``MAX_STAGES``, of the slowest replica), per replica slot (up to ``MAX_REPLICAS``), per node class
slot (up to ``MAX_CLASSES``) and global features; ``observation_features()`` names them.

Features and moves come in groups (``envs.layout``): the first ones above (``V1_OBSERVATIONS``, ``ACTIONS``),
then ``ZERO_FEATURES`` (ZeRO stage, offload shares, host memory used) and ``ZERO_ACTIONS``, then
``HEADROOM_FEATURES`` (the memory model's predicted peak over capacity of the current plan per node-class slot,
of its fullest device and of its fullest host) and ``SPACE_FEATURES`` (roundpipe, sequence parallelism,
mixed-stage width, the MoE choices, an MoE model, the slowest inter-node link's bandwidth and latency); the
default move list is ``FULL_ACTIONS`` = ``ACTIONS`` + ``ZERO_ACTIONS`` + ``EXTRA_ACTIONS`` (sequence
parallelism, RoundPipe's switch and knobs) + ``MOE_ACTIONS`` + ``MIXED_ACTIONS``, the same list on every cluster
and model (a move whose dimension the space lacks is masked).

``observation_features()`` names every feature in order.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from autotune.evaluator import CachedEvaluator, Evaluator
from autotune.planning import mixed_space, roundpipe_space
from autotune.planning.budget import BudgetedEvaluator, BudgetExhausted
from autotune.planning.encoding import ANCHOR, STATE_DIMENSIONS, sync_params
from autotune.planning.space import INTERLEAVED_CHUNKS, Params, SearchSpace, apportion
from autotune.specs import Measurement, ParallelConfig
from autotune.specs.recompute import rerun_fraction
from envs.layout import (
    CLASS_FEATURES,
    FAIL_PENALTY,
    FULL_ACTIONS,
    FULL_OBSERVATIONS,
    GLOBAL_FEATURES,
    HEADROOM_FEATURES,
    INVALID_PENALTY,
    MAX_CLASSES,
    MAX_REPLICAS,
    MAX_STAGES,
    REPLICA_FEATURES,
    STAGE_FEATURES,
    ZERO_FEATURES,
)
from envs.observation import observed, predicted_headroom, space_features


class ParallelConfigEnv(gym.Env):
    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        space: SearchSpace | None = None,
        evaluator: Evaluator | None = None,
        *,
        cluster: Any = None,
        model: Any = None,
        backend: str = "sim",
        max_steps: int = 32,
        random_start: bool = False,
        start_from_best: bool = False,
        render_mode: str | None = None,
        actions: tuple[tuple, ...] | None = None,
    ) -> None:
        super().__init__()
        if space is None:
            from autotune.loading import load_cluster, load_model

            if cluster is None or model is None:
                from autotune.errors import SpecError

                raise SpecError("ParallelConfigEnv", "space", "give a SearchSpace, or a cluster and a model")
            space = SearchSpace(load_cluster(cluster), load_model(model))
        self.space = space
        if evaluator is None:
            from autotune.evaluator import make_evaluator

            evaluator = make_evaluator(space.cluster, space.model, backend)
        self.evaluator: CachedEvaluator = (
            evaluator if isinstance(evaluator, CachedEvaluator) else CachedEvaluator(evaluator)
        )
        self.max_steps = max_steps
        self.random_start = random_start
        self.start_from_best = start_from_best
        self.render_mode = render_mode
        self.actions = FULL_ACTIONS if actions is None else actions  # the same list on every cluster and model
        self.action_space = spaces.Discrete(len(self.actions))
        n_obs = FULL_OBSERVATIONS
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(n_obs,), dtype=np.float32)
        self._dims = {d.name: d for d in space.dimensions}
        self._classes = space.node_classes[:MAX_CLASSES]
        self._starts = space.heuristic_params()
        self.params: Params = {}
        self.config: ParallelConfig | None = None
        self.measurement: Measurement | None = None
        self.score = 0.0
        self.start_score = 0.0
        self.best_score = 0.0
        self.steps = 0
        self._last_failed = False
        self._candidates: list[tuple[ParallelConfig, Params] | None] | None = None
        self._memory_sim: Any = None  # the memory model behind the headroom features (lazy)
        self._headroom: dict[ParallelConfig, np.ndarray] = {}

    # -- evaluations -------------------------------------------------------------------------------
    @property
    def evaluations(self) -> int:
        """Distinct plans evaluated through this env's evaluator (the budget count)."""
        return self.evaluator.used if isinstance(self.evaluator, BudgetedEvaluator) else self.evaluator.misses

    def _out_of_budget(self, config: ParallelConfig) -> bool:
        return (
            isinstance(self.evaluator, BudgetedEvaluator)
            and self.evaluator.exhausted
            and self.evaluator.would_cost(config)
        )

    def _evaluate(self, config: ParallelConfig, params: Params) -> Measurement:
        try:
            if isinstance(self.evaluator, BudgetedEvaluator):
                return self.evaluator.evaluate(config, params)
            return self.evaluator.evaluate(config)
        except BudgetExhausted as e:
            return Measurement.failure("failed", str(e))
        except Exception as e:  # the env never raises for a plan
            return Measurement.failure("failed", f"{type(e).__name__}: {e}")

    # -- gymnasium API -----------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        self.steps = 0
        self._last_failed = False
        self._candidates = None
        starts: list[Params] = []
        if "params" in options:
            starts.append(dict(options["params"]))
        order = list(range(len(self._starts)))
        if self.random_start and order:
            self.np_random.shuffle(order)
        starts += [self._starts[i] for i in order]
        if self.random_start or not starts:
            for _ in range(50):
                p = {d.name: d.choices[int(self.np_random.integers(len(d.choices)))] for d in self.space.dimensions}
                if self.space.decode(p).ok:
                    starts.append(p)
                    if len(starts) >= len(order) + 4:
                        break
        chosen = None
        first_valid = None
        budget_hit = False
        best = self.evaluator.best if isinstance(self.evaluator, BudgetedEvaluator) else None
        if (
            self.start_from_best
            and "params" not in options
            and best is not None
            and best.score > 0
            and set(best.params) >= set(self._dims)
        ):
            starts = []  # continue from the best plan this search has found (cached: free)
            chosen = (dict(best.params), best.config, best.measurement)
        for p in starts:
            decoded = self.space.decode(p)
            if not decoded.ok:
                continue
            if first_valid is None:
                first_valid = (p, decoded.config)
            if self._out_of_budget(decoded.config):
                budget_hit = True
                continue
            m = self._evaluate(decoded.config, p)
            if m.ok:
                chosen = (p, decoded.config, m)
                break
            if first_valid[1] == decoded.config:
                first_valid = (p, decoded.config, m)  # type: ignore[assignment]
        if chosen is None:
            if first_valid is None:
                p, _ = self.space.sample_valid(self.np_random)
                first_valid = (p, self.space.decode(p).config)
            p, cfg = first_valid[0], first_valid[1]
            m = first_valid[2] if len(first_valid) > 2 else Measurement.failure("failed", "not evaluated (no budget)")  # type: ignore[misc]
            chosen = (p, cfg, m)
        self.params, self.config, self.measurement = dict(chosen[0]), chosen[1], chosen[2]
        sync_params(self.params, self.config)
        self.score = self.start_score = self.best_score = self.measurement.score()
        info = self._info()
        info["budget_exhausted"] = budget_hit and not self.measurement.ok
        return self._observation(), info

    def step(self, action):
        a = int(action)
        self.steps += 1
        truncated = self.steps >= self.max_steps
        candidates = self._get_candidates()
        cand = candidates[a] if 0 <= a < len(candidates) else None
        if cand is None:
            info = self._info(invalid_action=True)
            return self._observation(), INVALID_PENALTY, False, truncated, info
        config, params = cand
        if config == self.config:  # noop
            return self._observation(), 0.0, False, truncated, self._info()
        if self._out_of_budget(config):
            info = self._info(budget_exhausted=True)
            return self._observation(), 0.0, False, True, info
        m = self._evaluate(config, params)
        if not m.ok:
            self._last_failed = True
            info = self._info(status="oom" if m.oom else m.status, error=m.error, failed_config=config)
            return self._observation(), FAIL_PENALTY, False, truncated, info
        prev = self.score
        new = m.score()
        reward = 1.0 if prev <= 0 else float(np.clip((new - prev) / prev, -1.0, 1.0))
        self.params, self.config, self.measurement, self.score = dict(params), config, m, new
        self.best_score = max(self.best_score, new)
        self._last_failed = False
        self._candidates = None
        return self._observation(), reward, False, truncated, self._info()

    def action_masks(self) -> np.ndarray:
        mask = np.array([c is not None for c in self._get_candidates()], dtype=bool)
        return mask

    def render(self):
        if self.render_mode == "ansi":
            return f"{self.config.describe() if self.config else '-'}  {self.score:,.0f} tokens/s"
        return None

    # -- moves ---------------------------------------------------------------------------------------
    def _get_candidates(self) -> list[tuple[ParallelConfig, Params] | None]:
        if self._candidates is None:
            cands: list[tuple[ParallelConfig, Params] | None] = [None]
            for act in self.actions[1:]:
                try:
                    res = self._apply(act)
                except Exception:  # a move that cannot be built is simply not offered
                    res = None
                if res is not None and (res[0] == self.config or self.space.check(res[0]) is not None):
                    res = None
                cands.append(res)
            if not any(c is not None for c in cands):
                cands[0] = (self.config, dict(self.params))  # type: ignore[assignment]
            self._candidates = cands
        return self._candidates

    def _apply(self, act: tuple) -> tuple[ParallelConfig, Params] | None:
        cfg = self.config
        if cfg is None:
            return None
        kind = act[0]
        if cfg.is_roundpipe:  # its knobs are dimensions: re-decode (RoundPipe cuts the stages itself)
            if kind == "mbs":
                choices = self._dims["mbs"].choices
                i = choices.index(cfg.micro_batch_size) + act[1] if cfg.micro_batch_size in choices else -1
                return self._redecode("mbs", value=choices[i]) if 0 <= i < len(choices) else None
            if kind == "schedule":  # leave RoundPipe for a pipeline plan with this schedule
                if act[1] not in self._dims["schedule"].choices:
                    return None
                params = dict(self.params, schedule=act[1], roundpipe=False)
                decoded = self.space.decode(params)
                return (decoded.config, params) if decoded.ok else None
            if kind == "dim":
                return self._redecode(act[1], step=act[2])
            return None
        if kind == "layer":
            return self._move_layer(act[1], act[2])
        if kind == "recompute":
            k = act[1]
            if not any(len(p.stages) > k for p in cfg.pipelines):
                return None
            pipes = tuple(
                replace(
                    p,
                    stages=tuple(
                        replace(s, recompute=not s.recompute) if i == k else s for i, s in enumerate(p.stages)
                    ),
                )
                for p in cfg.pipelines
            )
            return replace(cfg, pipelines=pipes), self.params
        if kind == "batch":
            return self._move_batch(act[1], act[2])
        if kind == "mbs":
            return self._change_mbs(act[1])
        if kind == "schedule":
            return self._change_schedule(act[1])
        if kind == "dim":
            return self._redecode(act[1], step=act[2])
        if kind == "share":
            moved = mixed_space.shift_share(self.space.context, cfg, act[1], act[2])
            return None if moved is None else (moved, self.params)
        if kind == "tp":
            if act[1] >= len(self._classes):
                return None
            return self._redecode(f"tp.{self._classes[act[1]].name}", step=act[2])
        if kind == "use":
            if act[1] >= len(self._classes) or f"use.{self._classes[act[1]].name}" not in self._dims:
                return None
            name = f"use.{self._classes[act[1]].name}"
            return self._redecode(name, value=not self.params.get(name, True))
        return None

    def _move_layer(self, k: int, direction: int) -> tuple[ParallelConfig, Params] | None:
        cfg = self.config
        q = cfg.virtual_stages if cfg.schedule == "interleaved-1f1b" else 1
        changed = False
        pipes = []
        for p in cfg.pipelines:
            layers = [s.layers for s in p.stages]
            if len(layers) > k + 1:
                src, dst = (k, k + 1) if direction > 0 else (k + 1, k)
                if layers[src] - q < q:
                    return None
                layers[src] -= q
                layers[dst] += q
                changed = True
            pipes.append(replace(p, stages=tuple(replace(s, layers=n) for s, n in zip(p.stages, layers))))
        if not changed:
            return None
        return replace(cfg, pipelines=tuple(pipes)), self.params

    def _replica_speeds(self, cfg: ParallelConfig) -> list[float]:
        return [
            self.space.replica_speed(
                [mixed_space.stage_speed(self.space.context, s) for s in p.stages], [s.layers for s in p.stages]
            )
            for p in cfg.pipelines
        ]

    def _move_batch(self, r: int, direction: int) -> tuple[ParallelConfig, Params] | None:
        cfg = self.config
        if r >= len(cfg.pipelines) or len(cfg.pipelines) < 2:
            return None
        speeds = self._replica_speeds(cfg)
        loads = [p.num_microbatches / s for p, s in zip(cfg.pipelines, speeds)]
        others = [i for i in range(len(cfg.pipelines)) if i != r]
        counts = [p.num_microbatches for p in cfg.pipelines]
        if direction < 0:  # from r to the least loaded other replica
            j = min(others, key=lambda i: loads[i])
            src, dst = r, j
        else:  # to r from the most loaded other replica
            j = max(others, key=lambda i: loads[i])
            src, dst = j, r
        q = len(cfg.pipelines[src].stages) if cfg.schedule == "interleaved-1f1b" else 1
        if counts[src] - q < q:
            return None
        counts[src] -= q
        counts[dst] += q
        pipes = tuple(mixed_space.rescale_shares(p, c) for c, p in zip(counts, cfg.pipelines))
        if any(p is None for p in pipes):
            return None
        return replace(cfg, pipelines=pipes), self.params

    def _change_mbs(self, direction: int) -> tuple[ParallelConfig, Params] | None:
        cfg = self.config
        choices = self._dims["mbs"].choices
        if cfg.micro_batch_size not in choices:
            return None
        i = choices.index(cfg.micro_batch_size) + direction
        if not 0 <= i < len(choices):
            return None
        mbs = choices[i]
        total = self.space.model.global_batch_size // mbs
        q = len(cfg.pipelines[0].stages) if cfg.schedule == "interleaved-1f1b" else 1
        counts = apportion(total, [p.num_microbatches for p in cfg.pipelines], minimum=q, quantum=q)
        if counts is None:
            return None
        pipes = tuple(mixed_space.rescale_shares(p, c) for c, p in zip(counts, cfg.pipelines))
        if any(p is None for p in pipes):
            return None
        return replace(cfg, micro_batch_size=mbs, pipelines=pipes), dict(self.params, mbs=mbs)

    def _change_schedule(self, schedule: str) -> tuple[ParallelConfig, Params] | None:
        cfg = self.config
        if schedule == cfg.schedule or schedule not in self._dims["schedule"].choices:
            return None
        if schedule != "interleaved-1f1b":
            return (replace(cfg, schedule=schedule, virtual_stages=1), dict(self.params, schedule=schedule))
        q = INTERLEAVED_CHUNKS
        pipes = []
        for p in cfg.pipelines:
            if len(p.stages) < 2:
                return None
            layers = [s.layers for s in p.stages]
            if any(n % q for n in layers):
                layers = apportion(self.space.model.num_layers, layers, minimum=q, quantum=q)
                if layers is None:
                    return None
            pipes.append(replace(p, stages=tuple(replace(s, layers=n) for s, n in zip(p.stages, layers))))
        pp = len(pipes[0].stages)
        if all(len(p.stages) == pp for p in pipes) and any(p.num_microbatches % pp for p in pipes):
            total = sum(p.num_microbatches for p in pipes)
            counts = apportion(total, [p.num_microbatches for p in pipes], minimum=pp, quantum=pp)
            if counts is None:
                return None
            pipes = [replace(p, num_microbatches=c) for c, p in zip(counts, pipes)]
        return replace(cfg, pipelines=tuple(pipes), schedule=schedule, virtual_stages=q), dict(
            self.params, schedule=schedule
        )

    def _redecode(self, name: str, step: int = 0, value: Any = None) -> tuple[ParallelConfig, Params] | None:
        dim = self._dims.get(name)
        if dim is None:
            return None
        if value is None:
            cur = self.params.get(name)
            if cur is None and name in ("zero", "offload") and self.config is not None:  # params from an older layout
                cur = self.config.zero if name == "zero" else self.config.pipelines[0].stages[0].offload
            if cur is None and name == roundpipe_space.SWITCH and self.config is not None:
                cur = bool(self.config.is_roundpipe)  # a start plan encoded before the switch existed
            if cur is None and name == "seq_parallel":
                cur = False
            if cur not in dim.choices:
                return None
            i = dim.choices.index(cur) + step
            if not 0 <= i < len(dim.choices):
                return None
            value = dim.choices[i]
        if value not in dim.choices:
            return None
        params = dict(self.params, **{name: value})
        if name not in STATE_DIMENSIONS:  # a structural move: an anchored plan (SearchSpace.encode) no longer applies
            params.pop(ANCHOR, None)
        decoded = self.space.decode(params)
        return (decoded.config, params) if decoded.ok else None

    # -- observation ---------------------------------------------------------------------------------
    def _observation(self) -> np.ndarray:
        cfg, m = observed(self.config), self.measurement
        if cfg is None:
            parts = [
                np.zeros(MAX_STAGES * len(STAGE_FEATURES) + MAX_REPLICAS * len(REPLICA_FEATURES), dtype=np.float32),
                np.zeros(MAX_CLASSES * len(CLASS_FEATURES) + len(GLOBAL_FEATURES) + len(ZERO_FEATURES), np.float32),
            ]
        else:
            stage_rep, pipe, peak = self._pipeline_features(cfg, m)
            parts = [stage_rep, self._setting_features(cfg, m, pipe, peak)]
        obs = np.concatenate([*parts, self._headroom_features(), self._space_features()])
        return np.clip(np.nan_to_num(obs, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0).astype(np.float32)

    def _pipeline_features(self, cfg: ParallelConfig, m: Measurement | None):
        """``STAGE_FEATURES`` of the busiest replica's stages and ``REPLICA_FEATURES`` of the replicas, flat;
        that replica and the measured peaks."""
        space = self.space
        L = space.model.num_layers
        stage_f = np.zeros((MAX_STAGES, len(STAGE_FEATURES)), dtype=np.float32)
        rep_f = np.zeros((MAX_REPLICAS, len(REPLICA_FEATURES)), dtype=np.float32)
        speeds = self._replica_speeds(cfg)
        counts = [p.num_microbatches for p in cfg.pipelines]
        loads = [c / s for c, s in zip(counts, speeds)]
        focus = int(np.argmax(loads))
        pipe = cfg.pipelines[focus]
        g_speeds = [mixed_space.stage_speed(space.context, s) for s in pipe.stages]
        max_speed = max(mixed_space.stage_speed(space.context, s) for p in cfg.pipelines for s in p.stages)
        busy = list(m.stage_busy_s) if m is not None and len(m.stage_busy_s) == len(pipe.stages) else []
        if not busy or sum(busy) <= 0:
            busy = [
                (s.layers + (space.head_extra if i == len(pipe.stages) - 1 else 0)) / g
                for i, (s, g) in enumerate(zip(pipe.stages, g_speeds))
            ]
        total_busy, max_busy = sum(busy), max(busy)
        peak = dict(m.peak_memory_GiB) if m is not None else {}
        for i, s in enumerate(pipe.stages[:MAX_STAGES]):
            dev = space.cluster.device(s.devices[0])
            used = max((peak.get(d, 0.0) for d in s.devices), default=0.0) / dev.memory_GiB
            if i + 1 < len(pipe.stages):
                bw = space.cluster.link(s.devices[0], pipe.stages[i + 1].devices[0]).bandwidth_GBps
                link = math.log10(max(bw, 0.01)) / 3.0
            else:
                link = 0.0
            stage_f[i] = (
                1.0,
                s.layers / L,
                busy[i] / total_busy,
                busy[i] / max_busy,
                min(used, 1.5) / 1.5,
                g_speeds[i] / max_speed,
                math.log2(s.tp) / 3.0,
                rerun_fraction(s.recompute),
                link,
                min(dev.memory_GiB / 160.0, 1.0),
            )
        total_mb, max_load = sum(counts), max(loads)
        max_rs = max(speeds)
        for r, p in enumerate(cfg.pipelines[:MAX_REPLICAS]):
            rep_f[r] = (
                1.0,
                counts[r] / total_mb,
                speeds[r] / max_rs,
                loads[r] / max_load,
                min(len(p.stages) / MAX_STAGES, 1.0),
            )
        return np.concatenate([stage_f.ravel(), rep_f.ravel()]), pipe, peak

    def _setting_features(self, cfg: ParallelConfig, m: Measurement | None, pipe, peak: dict) -> np.ndarray:
        """``CLASS_FEATURES``, ``GLOBAL_FEATURES`` and ``ZERO_FEATURES``, flat."""
        space = self.space
        L = space.model.num_layers
        cls_f = np.zeros((MAX_CLASSES, len(CLASS_FEATURES)), dtype=np.float32)
        glob = np.zeros(len(GLOBAL_FEATURES), dtype=np.float32)
        zero_f = np.zeros(len(ZERO_FEATURES), dtype=np.float32)
        max_peak = max(c.peak_tflops for c in self._classes)
        for c, nc in enumerate(self._classes):
            cls_f[c] = (
                1.0,
                float(self.params.get(f"use.{nc.name}", True)),
                math.log2(int(self.params.get(f"tp.{nc.name}", 1))) / 3.0,
                nc.peak_tflops / max_peak,
                min(nc.memory_GiB / 160.0, 1.0),
            )
        mbs_choices = self._dims["mbs"].choices
        mbs_i = mbs_choices.index(cfg.micro_batch_size) if cfg.micro_batch_size in mbs_choices else 0
        used_devs = len(cfg.devices)
        gain_start = math.log(self.score / self.start_score) if self.score > 0 and self.start_score > 0 else 0.0
        gain_best = math.log(self.score / self.best_score) if self.score > 0 and self.best_score > 0 else -1.0
        max_used = max(
            (v / space.cluster.device(d).memory_GiB for d, v in peak.items() if d in set(cfg.devices)), default=0.0
        )
        dims = self._dims

        def idx(name: str) -> float:
            ch = dims[name].choices
            return ch.index(self.params[name]) / max(len(ch) - 1, 1) if self.params.get(name) in ch else 0.0

        glob[:] = (
            mbs_i / max(len(mbs_choices) - 1, 1),
            float(cfg.schedule == "1f1b"),
            float(cfg.schedule == "gpipe"),
            float(cfg.schedule == "interleaved-1f1b"),
            min(len(pipe.stages) / MAX_STAGES, 1.0),
            min(math.log2(len(cfg.pipelines)) / 7.0, 1.0),
            1.0 - used_devs / space.cluster.num_devices,
            m.bubble_fraction if m is not None else 0.0,
            min(m.mfu, 1.0) if m is not None else 0.0,
            float(self._last_failed),
            float(np.clip(gain_start / 2.0, -1, 1)),
            float(np.clip(gain_best, -1, 0)),
            1.0 - self.steps / self.max_steps,
            min(max_used, 1.5) / 1.5,
            idx("layer_split"),
            idx("batch_split"),
            float(self.params.get("assign") == "mixed"),
            float(self.params.get("order") == "slow-first"),
            float(self.params.get("recompute") == "none"),
            float(self.params.get("recompute") == "all"),
            min(space.head_extra / L, 1.0),
            float(L % INTERLEAVED_CHUNKS == 0),
        )
        stages = [s for p in cfg.pipelines for s in p.stages]
        host = dict(m.host_memory_GiB) if m is not None else {}
        host_used = max(
            (gib / n.host.memory_GiB for n in space.cluster.nodes for k, gib in host.items() if k == n.name),
            default=0.0,
        )
        zero_f[:] = (
            cfg.zero / 3.0,
            sum(s.offload == "optimizer" for s in stages) / len(stages),
            sum(s.offload == "all" for s in stages) / len(stages),
            min(host_used, 1.5) / 1.5,
        )
        return np.concatenate([cls_f.ravel(), glob, zero_f])

    def _headroom_features(self) -> np.ndarray:
        """``HEADROOM_FEATURES`` of the current plan from the memory model (cached per plan)."""
        cfg = self.config
        if cfg is None:
            return np.zeros(len(HEADROOM_FEATURES), dtype=np.float32)
        cached = self._headroom.get(cfg)
        if cached is None:
            cached = predicted_headroom(self.space, cfg, self._memory_model())
            if len(self._headroom) > 4096:
                self._headroom.clear()
            self._headroom[cfg] = cached
        return cached

    def _memory_model(self) -> Any:
        if self._memory_sim is None:
            from autotune.planning.memory_first import search_simulator

            self._memory_sim = search_simulator(self.space, self.evaluator)
        return self._memory_sim

    def _space_features(self) -> np.ndarray:
        return space_features(self.space, self.config, self.params, self._dims)

    def _info(self, **extra: Any) -> dict[str, Any]:
        info = {
            "tokens_per_s": self.score,
            "best_tokens_per_s": self.best_score,
            "evaluations": self.evaluations,
            "config": self.config,
        }
        info.update(extra)
        return info
