"""The structured planner behind ``--method dp`` (after Sailor, Strati et al. SOSP'25, and Metis,
Um et al. ATC'24): compose a plan's iteration time from per-stage costs instead of searching blindly.

It decides the tensor-parallel groups (one degree per node class), how they chain into pipelines, the
layer split (recomputation only where needed to fit), the micro-batch size and the replicas' batch shares.
How it scores a plan, without running the simulator on whole plans:

1. Per stage: ``CostModel.stage_estimate`` (time per micro-batch, peak memory for ``l`` layers with ``q``
   micro-batches in flight: linear in ``l``, bilinear in ``l, q``; four queries give exact coefficients).
2. Per pipeline (an ordered list of group kinds): the layer split that minimises the slowest stage,
   by bisection on the bottleneck time ``B``: stage ``i`` can hold the most layers whose time is at
   most ``B`` and whose memory fits with ``min(m, p - i)`` micro-batches in flight (1F1B), with or
   without recomputation; the smallest ``B`` whose stages hold all the layers wins (the classic
   linear-partition problem with unequal processors). A pipeline with ``m`` micro-batches then takes
   ``(m - 1) * c + S + 2 * P`` (``c`` the slowest stage, ``S`` the sum of the stages, ``P`` the
   activation transfers along the pipeline), the 1F1B makespan.
3. Per plan (a set of replicas): the micro-batches split so that the replicas finish together
   (bisection on the finish time ``T``: a replica with ``(c, S)`` finishes ``m = (T - S) / c + 1``
   micro-batches by ``T``), plus the gradient all-reduce (the simulator's ring) and the optimizer step.

Plan families it enumerates (every micro-batch size of the space):

- ``per-class``: every node class forms its own identical replicas (tp, pp per class; a class may
  sit out), replicas of different classes side by side in one data-parallel group (Sailor's plans
  on A100 + V100, e.g. 8 A100 replicas at tp 1 beside 2 V100 replicas at tp 4);
- ``mixed``: identical replicas that each take stages from every class (a heterogeneous pipeline,
  classes in order of speed, reversed, or of memory), layers split by the partition above.
- ``sharded-dp`` (``autotune.planning.sharded_dp``): DeepSpeed-style ZeRO data parallelism, every
  tensor-parallel group one replica of the whole model, with the zero stage and offload that fit; these
  few plans are timed by the simulator itself (a one-stage replica has no pipeline to compose).
- memory-state variants of the first two (``autotune.planning.state_variants``, below): the same pipelines
  with ZeRO, offload, sequence parallelism or less recomputation, family e.g. ``mixed+zero3+offload-all``.
- ``mixed-stages`` (Zorse's stages of several ranks of different types), ``moe`` (SPES's expert subsets and
  sync period) and ``roundpipe`` (RoundPipe's settings), decoded around the best plans of the others; then
  the best plans' micro-batch size and layer split corrected by the simulator (``autotune.planning.refine``).

The first two families multiply their choices per node class: past ``MAX_COMBINATIONS`` (15 standalone
nodes: 5^15) the per-class family is a beam search over the classes (the ``BEAM_WIDTH`` best partial plans),
past ``MAX_MIXED_TP_CHOICES`` the mixed family varies one class's tp degree at a time.

The composition runs once per offload mode of the space (``none``; ``optimizer`` and ``all`` at the smallest
micro-batch size, their plans ZeRO-3 across replicas). Over the best structures of each
(``STRUCTURES_PER_PASS``), ``state_variants`` tries every ZeRO stage, offload mode, sequence parallelism and
recomputation the memory model says fits, timed by the simulator (the composed time leaves out ZeRO and
offload traffic), at most ``MAX_STATE_SIMULATIONS`` plans (fewer past 512 GPUs), ranked by that time among
the composed ones; when nothing fits without offload, the offload modes' composed plans are kept too.

The best few per family and micro-batch size, ranked by the composed time, are what ``run_dp`` sends to the
real evaluator (the simulator or real runs) within the budget; ``plan_candidates`` also starts ``optuna`` and
``rl`` (``autotune.search.api``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autotune.planning import sharded_dp, state_variants
from autotune.planning.candidate import Candidate
from autotune.planning.refine import refine
from autotune.planning.space import SearchSpace, valid_tp
from autotune.planning.vocabulary import composed_settings
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig

log = logging.getLogger(__name__)

#: pipeline depths the planner tries (also capped by layers and groups)
PP_CHOICES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)
#: options kept per node class for the per-class family (by steady-state throughput)
OPTIONS_PER_CLASS = 4
#: micro-batch sizes tried at most (powers of two first)
MAX_MBS_CHOICES = 6
#: per-class combinations scored exhaustively at most (OPTIONS_PER_CLASS + 1 choices per node class:
#: 5 classes); past that, a beam search over the classes keeps the BEAM_WIDTH best partial plans
MAX_COMBINATIONS = 3125
BEAM_WIDTH = 64
#: tp-degree combinations of the mixed family tried exhaustively at most (2 per class: 6 classes)
MAX_MIXED_TP_CHOICES = 64
#: composed plans per offload mode given memory-state variants, and the most variants timed (1-50 ms each)
STRUCTURES_PER_PASS = 6
MAX_STATE_SIMULATIONS = 64
#: the sharded data-parallel plans' variants timed (recomputation and layer-wise execution pay there: ZeRO-3
#: with torchtitan's selective-op and layer-wise execution is the best plan of 20 workstation GPUs)
SHARDED_SIMULATIONS = 64
STATE_SIMULATION_DEVICES = 32768  # fewer on large clusters (a plan's simulation grows with its devices)
#: micro-batch sizes the offload modes compose (the smallest first: offload is for plans that need memory)
OFFLOAD_MBS_CHOICES = 1
_BISECT_STEPS = 60
_BISECT_TOLERANCE = 1e-7  # relative, on the bottleneck / finish time


@dataclass(frozen=True, slots=True)
class GroupKind:
    """Tensor-parallel groups of one node class at one degree: all of them, in cluster order."""

    node_class: str
    tp: int
    groups: tuple[tuple[str, ...], ...]
    speed_tflops: float
    memory_GiB: float


@dataclass(frozen=True, slots=True)
class Template:
    """One pipeline shape: group kinds per stage, layers and recompute per stage, and its times."""

    kinds: tuple[int, ...]
    layers: tuple[int, ...]
    recompute: tuple[bool, ...]
    bottleneck_s: float  # slowest stage, forward + backward per micro-batch
    fill_s: float  # sum of the stages plus the activation transfers there and back
    optimizer_s: float


class Planner:
    """Plans for ``space``'s cluster and model, costed with ``simulator`` (a ``Simulator``)."""

    def __init__(self, space: SearchSpace, simulator) -> None:
        self.space = space
        self.sim = simulator
        self.costs = simulator.costs  # the pieces the planner composes (autotune.simulator.cost_model)
        self.model = space.model
        self.kinds: list[GroupKind] = []
        for c in space.node_classes:
            for tp in space._dims[f"tp.{c.name}"].choices if f"tp.{c.name}" in space._dims else (1,):
                if not valid_tp(self.model, tp):
                    continue
                groups = []
                for name in c.node_names:
                    ids = space.cluster.node_of(f"{name}:0").device_ids()
                    groups += [ids[g * tp : (g + 1) * tp] for g in range(len(ids) // tp)]
                self.kinds.append(GroupKind(c.name, tp, tuple(groups), tp * c.peak_tflops, c.memory_GiB))
        self._coef: dict[tuple, tuple[float, ...]] = {}
        self._p2p: dict[tuple, float] = {}
        self._partitions: dict[tuple, Template | None] = {}
        self.composed = 0  # plans composed by the last ``plan`` call
        self.offload = "none"  # offload of every stage of the plans being composed (``compose``)
        # --restrict: the recomputation a composed stage may take and the schedule it is built with
        self.recompute_modes, self.schedule = composed_settings(space._dims)

    # -- per-stage coefficients -------------------------------------------------------------------
    def _coefficients(self, k: int, mbs: int, recompute: bool, first: bool, last: bool) -> tuple[float, ...]:
        """(t1, dt, m11, dl, dq, dlq, opt1, dopt, usable): time ``t1 + (l-1) dt``; memory
        ``m11 + (l-1) dl + (q-1) dq + (l-1)(q-1) dlq``; optimizer ``opt1 + (l-1) dopt``."""
        key = (k, mbs, recompute, first, last, self.offload)
        hit = self._coef.get(key)
        if hit is None:
            devices = self.kinds[k].groups[0]
            e = {
                (n, q): self.costs.stage_estimate(devices, n, recompute, first, last, mbs, q, offload=self.offload)
                for n in (1, 2)
                for q in (1, 2)
            }
            t1 = e[1, 1].forward_s + e[1, 1].backward_s
            dt = e[2, 1].forward_s + e[2, 1].backward_s - t1
            m11 = e[1, 1].memory_GiB
            dl = e[2, 1].memory_GiB - m11
            dq = e[1, 2].memory_GiB - m11
            dlq = e[2, 2].memory_GiB - m11 - dl - dq
            hit = (
                t1,
                dt,
                m11,
                dl,
                dq,
                dlq,
                e[1, 1].optimizer_s,
                e[2, 1].optimizer_s - e[1, 1].optimizer_s,
                e[1, 1].usable_GiB,
            )
            self._coef[key] = hit
        return hit

    def _transfer_s(self, kinds: tuple[int, ...], i: int, j: int, mbs: int) -> float:
        """One micro-batch's activations between stages ``i`` and ``j`` of a pipeline of ``kinds``, placed
        as the first replica is built: a kind's stages take its groups in cluster order (so consecutive
        stages of one kind share a node while the node has groups, and cross the network after)."""
        gi, gj = kinds[:i].count(kinds[i]), kinds[:j].count(kinds[j])
        ga, gb = self.kinds[kinds[i]].groups, self.kinds[kinds[j]].groups
        src, dst = ga[min(gi, len(ga) - 1)], gb[min(gj, len(gb) - 1)]
        key = (src[0], dst[0], mbs)
        hit = self._p2p.get(key)
        if hit is None:
            hit = self._p2p[key] = self.costs.p2p_time_s(src, dst, mbs)
        return hit

    # -- one pipeline -------------------------------------------------------------------------------
    def partition(self, kinds: tuple[int, ...], mbs: int) -> Template | None:
        """The layer split of a pipeline of ``kinds`` that minimises its slowest stage (1F1B memory)."""
        key = (tuple(kinds), mbs, self.offload)
        if key not in self._partitions:
            self._partitions[key] = self._partition(tuple(kinds), mbs)
        return self._partitions[key]

    def _partition(self, kinds: tuple[int, ...], mbs: int) -> Template | None:
        p, L = len(kinds), self.model.num_layers
        if p > L:
            return None
        rows = {}
        for rc in (False, True):
            cols = [self._coefficients(k, mbs, rc, i == 0, i == p - 1) for i, k in enumerate(kinds)]
            rows[rc] = np.array(cols, dtype=float).T  # 9 x p
        blocking = self._blocking_sends(kinds)
        if blocking and p > 1:
            # a GPU stage's sends block it (the simulator's ``Simulator._blocking_sends``): each forward carries its
            # send to the next stage, each backward its send to the previous one
            sends = np.array(
                [
                    (self._transfer_s(kinds, i, i + 1, mbs) if i < p - 1 else 0.0)
                    + (self._transfer_s(kinds, i, i - 1, mbs) if i > 0 else 0.0)
                    for i in range(p)
                ]
            )
            for rc in rows:
                rows[rc] = rows[rc].copy()
                rows[rc][0] = rows[rc][0] + sends
        q = np.array([p - i for i in range(p)], dtype=float)  # 1F1B in-flight micro-batches (m >= p)

        def mem_layers(c: np.ndarray) -> np.ndarray:
            # largest l with m11 + (l-1) dl + (q-1) dq + (l-1)(q-1) dlq <= usable
            t1, dt, m11, dl, dq, dlq, _, _, usable = c
            base = m11 + (q - 1) * dq
            per = dl + (q - 1) * dlq
            room = usable - base
            with np.errstate(divide="ignore", invalid="ignore"):
                n = np.where(per > 0, np.floor(room / np.where(per > 0, per, 1.0)) + 1, np.where(room >= 0, L, 0))
            return np.where(room >= 0, np.clip(n, 0, L), 0)

        modes = self.recompute_modes
        limits = {rc: mem_layers(rows[rc]) for rc in rows}
        most = np.maximum.reduce([limits[rc] for rc in modes])
        if np.any(most < 1) or np.sum(most) < L:
            return None

        stages = list(zip(*[zip(rows[rc][0].tolist(), rows[rc][1].tolist(), limits[rc].tolist()) for rc in modes]))

        def most_layers(B: float) -> list[float]:
            """Per stage, the most layers it runs within ``B`` s per micro-batch in any mode (asked ~40 times per
            partition on p <= 8 stages: plain floats, not numpy calls on arrays of a few elements)."""
            out = []
            for lines in stages:  # (t1, dt, cap) per mode
                best = 0.0
                for t1, dt, cap in lines:
                    if B >= t1:
                        q = (B - t1) / dt if dt > 0 else L  # >= 0; past L the cap (<= L) decides
                        n = min(math.floor(q) + 1 if q < L else L, cap)
                        if n > best:
                            best = n
                out.append(best)
            return out

        def enough(B: float) -> bool:
            n = most_layers(B)
            return min(n) >= 1 and sum(n) >= L

        lo = float(np.max(np.minimum.reduce([rows[rc][0] for rc in modes]))) * (1 - 1e-12)  # one layer each
        hi = float(np.max(np.maximum.reduce([rows[rc][0] + (L - 1) * rows[rc][1] for rc in modes]))) * 2 + 1e-9
        if not enough(hi):
            return None
        for _ in range(_BISECT_STEPS):
            if hi - lo <= _BISECT_TOLERANCE * hi:
                break
            mid = (lo + hi) / 2
            if enough(mid):
                hi = mid
            else:
                lo = mid
        layers = [int(x) for x in most_layers(hi)]

        def stage_time(i: int, n: int) -> tuple[float, bool]:
            for rc in modes:
                t1, dt = rows[rc][0][i], rows[rc][1][i]
                if n <= limits[rc][i]:
                    return t1 + (n - 1) * dt, rc
            return math.inf, True

        excess = sum(layers) - L
        heap = [(-stage_time(j, layers[j])[0], j) for j in range(p) if layers[j] > 1]
        heapq.heapify(heap)
        while excess > 0:  # take layers back from the slowest stages that can spare one
            _, i = heapq.heappop(heap)
            layers[i] -= 1
            excess -= 1
            if layers[i] > 1:
                heapq.heappush(heap, (-stage_time(i, layers[i])[0], i))
        times, rcs, opt = [], [], 0.0
        for i in range(p):
            t, rc = stage_time(i, layers[i])
            times.append(t)
            rcs.append(rc)
            c = rows[rc][:, i]
            opt = max(opt, c[6] + (layers[i] - 1) * c[7])
        comm = 0.0 if blocking else sum(self._transfer_s(kinds, i, i + 1, mbs) for i in range(p - 1))
        return Template(tuple(kinds), tuple(layers), tuple(rcs), max(times), sum(times) + 2 * comm, opt)

    def _blocking_sends(self, kinds: tuple[int, ...]) -> bool:
        """GPU pipelines send synchronously (the simulator charges each send to its sender); CPU ranks overlap."""
        return self.space.cluster.device(self.kinds[kinds[0]].groups[0][0]).name != "cpu"

    # -- replicas side by side --------------------------------------------------------------------
    @staticmethod
    def finish_time_s(types: Sequence[tuple[int, float, float]], total: int) -> float | None:
        """When replicas of types ``(count, c, S)`` finish ``total`` micro-batches together: the
        smallest ``T`` with ``sum count * ((T - S) // c + 1) >= total`` (every replica takes one at
        least). None when there are more replicas than micro-batches."""
        n_rep = sum(n for n, _, _ in types)
        if n_rep > total or n_rep == 0:
            return None
        lo = max(S for _, _, S in types)
        hi = lo + max(c for _, c, _ in types) * total

        def count(T: float) -> int:
            return sum(n * (int((T - S) / c) + 1 if c > 0 else total) for n, c, S in types)

        if count(lo) >= total:
            return lo
        for _ in range(_BISECT_STEPS):
            if hi - lo <= _BISECT_TOLERANCE * hi:
                break
            mid = (lo + hi) / 2
            if count(mid) >= total:
                hi = mid
            else:
                lo = mid
        return hi

    @classmethod
    def split_batch(cls, types: Sequence[tuple[int, float, float]], total: int) -> list[int] | None:
        """Micro-batches per replica (types in order, ``count`` replicas each) so that all finish
        together; the few left over go to the replicas that finish first."""
        T = cls.finish_time_s(types, total)
        if T is None:
            return None
        shares, ends = [], []
        for n, c, S in types:
            m = max(1, int((T - S) / c) + 1) if c > 0 else total
            for _ in range(n):
                ends.append((c, S, len(shares)))
                shares.append(m)
        excess = sum(shares) - total
        if excess > 0:
            heap = [(-((shares[k] - 1) * c + S), k, c, S) for c, S, k in ends if shares[k] > 1]
            heapq.heapify(heap)
            while excess > 0 and heap:
                _, k, c, S = heapq.heappop(heap)
                shares[k] -= 1
                excess -= 1
                if shares[k] > 1:
                    heapq.heappush(heap, (-((shares[k] - 1) * c + S), k, c, S))
        return shares

    def _allreduce_s(self, pipes: list[list[tuple[tuple[str, ...], int]]], ring: int) -> float:
        """Data-parallel gradient sync after the pipelines: per run of layers held by the same stage
        in every replica, the simulator's ring all-reduce among those stages; a stage's runs add up.
        ``pipes`` are the replicas that stand for the others (the first and last of each type: the
        ring's slowest hop is among them); the ring has ``ring`` members. Rings are new all the time:
        each is combined from its stages' ``dp_stage`` (``CostModel.ring_of``), not looked up."""
        if ring < 2:
            return 0.0
        model, costs = self.model, self.costs
        L = model.num_layers
        starts: dict[int, list[int]] = {}  # layer index -> the pipes whose next stage starts there
        stages = []  # per pipe, its stages' dp_stage; the walk below advances each pipe's owning stage
        for r, pipe in enumerate(pipes):
            acc = 0
            for s, (_, n) in enumerate(pipe):
                if s:
                    starts.setdefault(acc, []).append(r)
                acc += n
            stages.append([costs.dp_stage(dev) for dev, _ in pipe])
        cuts = sorted({0, L, *starts})
        owners = [0] * len(pipes)
        totals = [[0.0] * len(pipe) for pipe in pipes]
        per_layer = model.params_per_layer  # a computed property: read once, not per run of layers
        for x, y in zip(cuts, cuts[1:]):
            for r in starts.get(x, ()):
                owners[r] += 1
            params = (y - x) * per_layer + model.end_params(x == 0, y == L)
            t = costs.ring_allreduce_s(costs.ring_of([row[s] for row, s in zip(stages, owners)]), params, ring)
            for row, s in zip(totals, owners):
                row[s] += t
        return max(max(row) for row in totals)

    def _score(self, types: list[tuple[Template, list[tuple[tuple[str, ...], ...]]]], mbs: int) -> float | None:
        """Composed iteration time of replica types (a template and the device groups of each of its
        replicas): the replicas' common finish, the gradient all-reduce, the optimizer step."""
        total = self.model.global_batch_size // mbs
        T = self.finish_time_s([(len(reps), t.bottleneck_s, t.fill_s) for t, reps in types], total)
        if T is None:
            return None
        stand_ins = []
        for t, reps in types:
            for g in {0: reps[0], len(reps) - 1: reps[-1]}.values():
                stand_ins.append([(dev, n) for dev, n in zip(g, t.layers)])
        ring = sum(len(reps) for _, reps in types)
        return T + self._allreduce_s(stand_ins, ring) + max(t.optimizer_s for t, _ in types)

    def _build(
        self, types: list[tuple[Template, list[tuple[tuple[str, ...], ...]]]], mbs: int
    ) -> ParallelConfig | None:
        shares = self.split_batch(
            [(len(reps), t.bottleneck_s, t.fill_s) for t, reps in types], self.model.global_batch_size // mbs
        )
        if shares is None:
            return None
        pipelines = []
        for t, reps in types:
            for g in reps:
                stages = tuple(StageConfig(dev, n, rc, self.offload) for dev, n, rc in zip(g, t.layers, t.recompute))
                pipelines.append(PipelineConfig(shares[len(pipelines)], stages))
        zero = 3 if self.offload != "none" and len(pipelines) > 1 and 3 in self.space._dims["zero"].choices else 0
        config = ParallelConfig(mbs, tuple(pipelines), self.schedule, zero=zero)
        return config if self.space.check(config) is None else None

    # -- families -----------------------------------------------------------------------------------
    def _pp_choices(self, groups: int) -> list[int]:
        allowed = self.space.restrict.get("pp")  # --restrict pp=...: those depths only
        depths = sorted({int(p) for p in allowed}) if allowed else PP_CHOICES
        return [p for p in depths if p <= min(groups, self.model.num_layers)]

    def _homogeneous(self, mbs: int) -> dict[str, list[tuple[float, int, Template]]]:
        """Per node class: (micro-batches per second of all its replicas, kind, template), best first."""
        by_class: dict[str, list[tuple[float, int, Template]]] = {}
        for k, kind in enumerate(self.kinds):
            for pp in self._pp_choices(len(kind.groups)):
                t = self.partition((k,) * pp, mbs)
                if t is not None:
                    by_class.setdefault(kind.node_class, []).append((len(kind.groups) // pp / t.bottleneck_s, k, t))
        return {c: sorted(rows, key=lambda r: -r[0]) for c, rows in by_class.items()}

    def _replicas(self, k: int, t: Template) -> list[tuple[tuple[str, ...], ...]]:
        pp, groups = len(t.kinds), self.kinds[k].groups
        return [groups[j * pp : (j + 1) * pp] for j in range(len(groups) // pp)]

    def _per_class(self, mbs: int, homogeneous: dict[str, list[tuple[float, int, Template]]]) -> list[_Draft]:
        options: list[list[tuple[int, Template] | None]] = []
        for c in self.space.node_classes:
            opts = homogeneous.get(c.name, [])[:OPTIONS_PER_CLASS]
            options.append([(k, t) for _, k, t in opts] + [None])
        if math.prod(len(o) for o in options) > MAX_COMBINATIONS:  # many node classes: 5^15 would never end
            return self._per_class_beam(mbs, options)
        out = []
        for combo in itertools.product(*options):
            types = [(t, self._replicas(k, t)) for k, t in (c for c in combo if c is not None)]
            if not types:
                continue
            est = self._score(types, mbs)
            if est is not None:
                out.append(_Draft(est, "per-class", mbs, types))
        return out

    def _per_class_beam(self, mbs: int, options: list[list[tuple[int, Template] | None]]) -> list[_Draft]:
        """``_per_class`` when the classes' options multiply past ``MAX_COMBINATIONS``: the classes are
        added one at a time (most options first), each partial plan extended by every option of the next
        class (or leaving it out), and only the ``BEAM_WIDTH`` best partial plans by composed time kept
        (a partial plan is itself a plan: the classes not yet added sit out)."""
        order = sorted(range(len(options)), key=lambda i: -len(options[i]))
        beam: dict[tuple[tuple[int, int], ...], float] = {(): math.inf}  # (class, option) pairs -> estimate
        drafts: list[_Draft] = []
        for i in order:
            grown = dict(beam)  # class i sits out
            for chosen in beam:
                for j, opt in enumerate(options[i]):
                    if opt is None:
                        continue
                    combo = chosen + ((i, j),)
                    types = [(t, self._replicas(k, t)) for k, t in (options[a][b] for a, b in sorted(combo))]
                    est = self._score(types, mbs)
                    if est is not None:
                        grown[combo] = est
                        drafts.append(_Draft(est, "per-class", mbs, types))
            kept = heapq.nsmallest(BEAM_WIDTH, (c for c in grown if c), key=grown.__getitem__)
            beam = {(): math.inf, **{c: grown[c] for c in kept}}
        return drafts

    def _mixed(self, mbs: int, homogeneous: dict[str, list[tuple[float, int, Template]]]) -> list[_Draft]:
        # per class, the two tp degrees of its best homogeneous replicas; a class that cannot hold the
        # model alone (no homogeneous option) joins mixed pipelines at its two widest degrees
        best_tp: dict[str, list[int]] = {}
        for cname, rows in homogeneous.items():
            for _, k, _ in rows:
                tps = best_tp.setdefault(cname, [])
                if self.kinds[k].tp not in tps and len(tps) < 2:
                    tps.append(self.kinds[k].tp)
        for k in sorted(range(len(self.kinds)), key=lambda i: -self.kinds[i].tp):
            cname = self.kinds[k].node_class
            if cname not in homogeneous:
                tps = best_tp.setdefault(cname, [])
                if len(tps) < 2:
                    tps.append(self.kinds[k].tp)
        classes = [c for c in self.space.node_classes if best_tp.get(c.name)]
        if len(classes) < 2:
            return []
        choices = [best_tp[c.name] for c in classes]
        if math.prod(len(t) for t in choices) > MAX_MIXED_TP_CHOICES:
            # many classes: every class at its first degree, and each class alone at its second
            first = tuple(t[0] for t in choices)
            tp_sets = [first] + [first[:i] + (t[1],) + first[i + 1 :] for i, t in enumerate(choices) if len(t) > 1]
        else:
            tp_sets = list(itertools.product(*choices))
        out = []
        for tps in tp_sets:
            ks = [
                next(i for i, kd in enumerate(self.kinds) if kd.node_class == c.name and kd.tp == tp)
                for c, tp in zip(classes, tps)
            ]
            counts = [len(self.kinds[k].groups) for k in ks]
            dps = sorted({d for d in range(1, min(counts) + 1) if d & (d - 1) == 0 or any(n % d == 0 for n in counts)})
            idx = range(len(ks))
            orders = {
                tuple(sorted(idx, key=lambda i: -self.kinds[ks[i]].speed_tflops)),
                tuple(sorted(idx, key=lambda i: self.kinds[ks[i]].speed_tflops)),
                tuple(sorted(idx, key=lambda i: -self.kinds[ks[i]].memory_GiB)),
            }
            for dp in dps:
                per = [n // dp for n in counts]
                if sum(per) > self.model.num_layers:
                    continue
                for order in orders:
                    t = self.partition(tuple(ks[i] for i in order for _ in range(per[i])), mbs)
                    if t is None:
                        continue
                    reps = []
                    for j in range(dp):
                        g: list[tuple[str, ...]] = []
                        for i in order:
                            g += self.kinds[ks[i]].groups[j * per[i] : (j + 1) * per[i]]
                        reps.append(tuple(g))
                    est = self._score([(t, reps)], mbs)
                    if est is not None:
                        out.append(_Draft(est, "mixed", mbs, [(t, reps)]))
        return out

    def _mbs_choices(self) -> list[int]:
        choices = list(self.space._dims["mbs"].choices)
        pow2 = [m for m in choices if m & (m - 1) == 0]
        rest = [m for m in choices if m & (m - 1)]
        return (pow2 + rest)[:MAX_MBS_CHOICES]

    def plan(self, limit: int = 64) -> list[Candidate]:
        """Distinct valid plans, best estimate first (at most ``limit``): the plans composed without offload
        (composed time), the memory-state variants of the best composed per offload mode
        (``state_variants``: ZeRO, offload, sequence parallelism, recomputation; simulated time) and the
        sharded data-parallel plans (``sharded_dp.candidates``, simulated time)."""
        offloads = [o for o in ("none", "optimizer", "all") if o in self.space._dims["offload"].choices]
        self.composed = 0
        # the offload passes compose at the smallest micro-batch sizes only: their plans are for memory
        passes = {
            o: self.compose(o, limit) if o == "none" else self.compose(o, STRUCTURES_PER_PASS, OFFLOAD_MBS_CHOICES)
            for o in offloads
        }
        # the best structures of every pass in turn, so that each pass's best are timed within the cap
        rounds = itertools.zip_longest(*(p[:STRUCTURES_PER_PASS] for p in passes.values()))
        structures = [c for row in rounds for c in row if c is not None]
        cap = min(MAX_STATE_SIMULATIONS, max(16, STATE_SIMULATION_DEVICES // self.space.cluster.num_devices))
        varied = state_variants.variants(self.space, self.sim, structures, cap)
        out = list(passes.get("none", [])) + varied
        if not passes.get("none"):  # nothing fits without offload: the offload passes' plans, composed time
            out += next((p for p in passes.values() if p), [])
        kinds = [(k.node_class, k.tp, k.groups, k.speed_tflops) for k in self.kinds]
        sharded = sharded_dp.candidates(self.space, self.sim, kinds)
        out += sharded + state_variants.variants(self.space, self.sim, sharded, SHARDED_SIMULATIONS)
        return refine(self.space, self.sim, out)[:limit]  # the families around these, the split corrected

    def compose(self, offload: str, limit: int, mbs_choices: int | None = None) -> list[Candidate]:
        """The best ``limit`` distinct plans composed with every stage's ``offload``, at the first
        ``mbs_choices`` micro-batch sizes (all by default), best composed time first."""
        self.offload = offload
        try:
            return self._plan(limit, mbs_choices)
        finally:
            self.offload = "none"

    def _plan(self, limit: int, mbs_choices: int | None) -> list[Candidate]:
        t0 = time.perf_counter()
        drafts: list[_Draft] = []
        for mbs in self._mbs_choices()[:mbs_choices]:
            homogeneous = self._homogeneous(mbs)
            drafts += self._per_class(mbs, homogeneous)
            drafts += self._mixed(mbs, homogeneous)
        drafts.sort(key=lambda d: d.estimate_s)
        self.composed += len(drafts)
        out, seen = [], set()
        for d in drafts:
            config = self._build(d.types, d.mbs)
            if config is not None and config not in seen:
                seen.add(config)
                out.append(Candidate(config, d.estimate_s, d.family))
            if len(out) >= limit:
                break
        log.info(
            "dp: %d plans composed (offload %s) in %.2f s; best estimate %.3f s",
            len(drafts),
            self.offload,
            time.perf_counter() - t0,
            out[0].estimate_s if out else float("nan"),
        )
        return out


@dataclass(slots=True)
class _Draft:
    estimate_s: float
    family: str
    mbs: int
    types: list


def simulator_of(evaluator):
    """The simulator behind an evaluator (the budgeted one, a screen, ...), else None."""
    from autotune.simulator import Simulator

    seen = 0
    while evaluator is not None and seen < 8:
        if isinstance(evaluator, Simulator):
            return evaluator
        evaluator = getattr(evaluator, "inner", None) or getattr(evaluator, "simulator", None)
        seen += 1
    return None


def planned(space: SearchSpace, evaluator, limit: int) -> list[Candidate]:
    """The planner's first ``limit`` plans for ``space``, costed by the simulator behind ``evaluator`` (its
    profile included) or, when there is none (real runs), by the datasheet simulator."""
    from autotune.simulator import Simulator

    return Planner(space, simulator_of(evaluator) or Simulator(space.cluster, space.model)).plan(limit)


def plan_candidates(space: SearchSpace, evaluator=None, limit: int = 64, ahead: list | None = None) -> list[Candidate]:
    """The planner's first ``limit`` plans for ``space`` that ``evaluator`` would not refuse (its ``refusal``, where
    it has one: the runner's limits; the refused ones it evaluates, free, so that it records them as evaluating them
    would), of ``planned``'s first ``4 * limit`` (``ahead``: those, computed earlier: while an MLflow writer starts)."""
    refusal = getattr(evaluator, "refusal", None)
    if refusal is None:
        return planned(space, evaluator, limit)
    out = []
    for c in ahead if ahead is not None else planned(space, evaluator, 4 * limit):
        if refusal(c.config) is None:
            out.append(c)
        else:
            evaluator.evaluate(c.config)  # an invalid proposal, free: the search says what it left out
    return out[:limit]
