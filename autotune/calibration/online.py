"""Closing the loop: measured runs correct the simulator's calibration while a search goes on.

When a search evaluates plans with real profiled runs (``--backend real``), each run is a measurement
of the simulator's error. ``OnlineCalibrator`` keeps them and refits a few correction factors by
least squares, so the simulator used for the rest of the budget is closer to the machine:

- ``compute[type]``: one factor per device type on every compute time (matmul rate, measured layer,
  embedding/head, optimizer and runtime-overhead times). Fitted to the measured per-stage busy times
  (forward + backward per step, which the runner clocks) and the iteration times.
- ``link[class]``: one factor per link class on its transfer time (latency and 1 / bandwidth), fitted to the
  iteration times (busy times carry no communication). The classes: ``network`` (every node's link to the
  others) and ``intra:<GPU type>`` (the links inside the nodes of that type), so a wrong network and a node
  type on PCIe where the file says NVLink are told apart. A class is fitted only once a measured plan uses it
  (a plan across nodes; one with several devices on a node of that type): ``Corrections.identified``.
- ``contention[type]``: one factor on the excess of the host-contention stretch (``stretch - 1``),
  for device types whose profile has a contention curve (CPU ranks sharing one machine).
- ``memory[type]``: an additive offset (GiB) on the per-process memory baseline, the mean residual
  of measured minus predicted peak memory (closed-form least squares). A run that ran out of memory is a
  censored measurement: some device's true peak exceeded its memory. Where the corrected model still
  says the plan fits, the offset of the type of its fullest device (the least headroom) rises until it
  does not (``OOM_MARGIN_GiB`` beyond), so no later plan needing as much there is spent on a real run.

The time factors are fitted in log space (residual ``log(predicted / measured)``) with
``scipy.optimize.least_squares`` and a weak ridge prior toward 1 (``prior_weight``; on the link classes,
which are either about right or off 10-40x, a heavy-tailed one: ``link_prior``), so one or two
measurements move them only as far as the data supports, and a factor the data cannot see (no
plan measured yet across nodes: ``link[network]``) stays at 1. Each refit re-simulates the measured plans with
the candidate factors; the simulator costs milliseconds per plan, so this is cheap next to one real run.
From three runs on, a refit is kept only if it predicts held-out runs better than the uncorrected
profile (k-fold cross-validation, ``refit``): corrections must not make a good profile worse.

The search helper calls ``update(config, measured)`` after every real run and evaluates the next
plans with ``corrected_simulator()``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field, replace

from autotune.profile import CalibrationProfile, DeviceProfile, NodeLinks
from autotune.specs import ClusterSpec, LinkSpec, Measurement, ModelSpec, ParallelConfig

log = logging.getLogger(__name__)

#: how far past its memory an out-of-memory run's fullest device is put (``OnlineCalibrator``)
OOM_MARGIN_GiB = 0.05


@dataclass(frozen=True, slots=True)
class Corrections:
    """Fitted correction factors (1.0 / 0.0 = no correction)."""

    compute: tuple[tuple[str, float], ...] = ()
    link: tuple[tuple[str, float], ...] = ()  # link class (``network``, ``intra:<GPU type>``) -> factor
    contention: tuple[tuple[str, float], ...] = ()
    memory_GiB: tuple[tuple[str, float], ...] = ()

    def to_dict(self) -> dict:
        return {
            "compute": dict(self.compute),
            "link": dict(self.link),
            "contention": dict(self.contention),
            "memory_GiB": dict(self.memory_GiB),
        }

    @property
    def identified(self) -> tuple[str, ...]:
        """The terms the runs so far have fitted (the others are at their defaults)."""
        return tuple(
            [f"compute:{t}" for t, _ in self.compute]
            + [f"link:{c}" for c, _ in self.link]
            + [f"contention:{t}" for t, _ in self.contention]
            + [f"memory:{t}" for t, _ in self.memory_GiB]
        )


NETWORK = "network"


def link_class(node) -> str:
    """The link class of a node's intra-node links (``Corrections.link``)."""
    return f"intra:{node.device.name}"


def link_classes(cluster: ClusterSpec, config: ParallelConfig) -> set[str]:
    """The link classes ``config`` moves data over: ``network`` when it spans nodes, ``intra:<type>`` when it
    puts several devices on one node of that type."""
    nodes = Counter(cluster.node_of(d) for d in config.devices)
    out = {NETWORK} if len(nodes) > 1 else set()
    return out | {link_class(n) for n, k in nodes.items() if k > 1}


def default_profile(cluster: ClusterSpec, precision: str = "bf16") -> CalibrationProfile:
    """A profile equal to the simulator's built-in datasheet model (``autotune.simulator.efficiency``) for
    a model trained in ``precision``: its matmul curve at that precision's peak, with the memory roofline
    (``matmul_roofline``), so the corrections have numbers to scale when no ``autotune profile`` file was
    given and a run the datasheet predicts exactly moves no factor."""
    from autotune.simulator.efficiency import DeviceRates

    devices = {}
    for node in cluster.nodes:
        d = node.device
        if d.name in devices:
            continue
        rates = DeviceRates(d, precision=precision)  # the datasheet model itself, sampled
        sizes = [2.0 ** (k / 8) for k in range(8, 8 * 17)]  # dense in log n: interpolation ~ the formula
        curve = tuple((n, rates.matmul_tflops(n)) for n in sizes)
        devices[d.name] = DeviceProfile(d.name, curve, rates.memory_bandwidth_GBps, matmul_roofline=True)
    return CalibrationProfile(devices=tuple(devices.values()), notes="datasheet model (no profile given)")


def _scale_link(link: LinkSpec, factor: float) -> LinkSpec:
    return LinkSpec(link.bandwidth_GBps / factor, link.latency_us * factor)


def apply_corrections(profile: CalibrationProfile, cluster: ClusterSpec, corr: Corrections) -> CalibrationProfile:
    """``profile`` with the corrections folded in: compute times x factor, links x factor, contention
    excess x factor, memory baseline + offset. The result is an ordinary profile (it can be saved)."""
    compute = dict(corr.compute)
    contention = dict(corr.contention)
    memory = dict(corr.memory_GiB)
    devices = []
    for d in profile.devices:
        c = compute.get(d.name, 1.0)
        k = contention.get(d.name, 1.0)
        layers = tuple(replace(x, forward_s=x.forward_s * c, backward_s=x.backward_s * c) for x in d.layers)
        edges = tuple(
            replace(
                e,
                embedding_forward_s=e.embedding_forward_s * c,
                embedding_backward_s=e.embedding_backward_s * c,
                head_forward_s=e.head_forward_s * c,
                head_backward_s=e.head_backward_s * c,
            )
            for e in d.edges
        )
        devices.append(
            replace(
                d,
                matmul=tuple((n, t / c) for n, t in d.matmul),
                memory_bandwidth_GBps=d.memory_bandwidth_GBps / c
                if d.memory_bandwidth_GBps
                else d.memory_bandwidth_GBps,
                layers=layers,
                edges=edges,
                optimizer_s_per_param=d.optimizer_s_per_param * c if d.optimizer_s_per_param is not None else None,
                microbatch_overhead_s=d.microbatch_overhead_s * c if d.microbatch_overhead_s is not None else None,
                # a baseline cannot go below zero: an offset larger than the baseline is cut there
                memory_baseline_GiB=max(0.0, (d.memory_baseline_GiB or 0.0) + memory.get(d.name, 0.0))
                if (d.memory_baseline_GiB is not None or d.name in memory)
                else None,
                contention=tuple((n, 1.0 + (s - 1.0) * k) for n, s in d.contention),
            )
        )
    missing_mem = set(memory) - {d.name for d in profile.devices}
    if missing_mem:
        log.debug("memory offsets for device types without a profile entry are ignored: %s", sorted(missing_mem))
    links = []
    factors = dict(corr.link)
    if any(v != 1.0 for v in factors.values()):
        for node in cluster.nodes:
            nl = profile.node_links(node.name)
            intra = nl.intra_node if nl and nl.intra_node else node.intra_node
            net = nl.network if nl and nl.network else node.network
            intra = _scale_link(intra, factors.get(link_class(node), 1.0))
            links.append(NodeLinks(node.name, intra, _scale_link(net, factors.get(NETWORK, 1.0))))
        others = [nl for nl in profile.links if nl.node not in {n.name for n in cluster.nodes}]
        links += others
    else:
        links = list(profile.links)
    note = f"online corrections {corr.to_dict()}"
    return replace(
        profile, devices=tuple(devices), links=tuple(links), notes=f"{profile.notes}; {note}" if profile.notes else note
    )


@dataclass
class _Observation:
    config: ParallelConfig
    measured: Measurement


def _timed(measured: Measurement) -> bool:
    """Whether a run finished with an iteration time the fit can take (not out of memory, finite, > 0)."""
    return measured.status == "ok" and not measured.oom and 0 < measured.iteration_time_s < math.inf


def run_residuals(sim, obs: list[_Observation]) -> list[float]:
    """The fit's residuals of ``obs`` under ``sim``: per run ``log(predicted / measured)`` and half-weighted
    ones per stage it measured busy. Always one slot per run and one per measured busy stage, whatever the
    factors: the busy times are the slowest replica's, which one that is moves with the factors where
    replicas have different stage counts, and ``least_squares`` needs a vector of one length (when the count
    moved, it raised, and a closed-loop search recorded the real run as failed)."""
    res = []
    for o in obs:
        meas_busy = [b for b in o.measured.stage_busy_s if b > 0]
        pred = sim.evaluate(o.config)
        if pred.status != "ok" or pred.iteration_time_s <= 0:
            res.append(5.0)  # a plan the run finished must not become infeasible
            res.extend([2.5] * len(meas_busy))
            continue
        res.append(math.log(pred.iteration_time_s / o.measured.iteration_time_s))
        if len(meas_busy) == len(pred.stage_busy_s):
            res.extend(0.5 * math.log(max(p, 1e-12) / m) for p, m in zip(pred.stage_busy_s, meas_busy))
        else:
            res.extend([0.0] * len(meas_busy))  # another replica is the slowest under these factors
    return res


def link_prior(theta, scale: float):
    """A link class's prior residual at log-factors ``theta``: ``theta`` near 0, growing only as
    ``scale * sqrt(log(1 + (theta / scale)^2))`` past ``scale`` (a Cauchy prior's, signed, so the fit's
    finite differences see a smooth slope through 0)."""
    import numpy as np

    return np.sign(theta) * scale * np.sqrt(np.log1p((np.asarray(theta) / scale) ** 2))


#: the second starting point of the link factors' descent (``OnlineCalibrator._fit_time``)
LINK_START = 10.0


@dataclass
class OnlineCalibrator:
    """Refits correction factors from measured runs; hands out a corrected simulator.

    ``simulator`` is the ``autotune.simulator.Simulator`` in use (its cluster, model and profile are
    the starting point). ``prior_weight`` is the ridge weight pulling each log-factor to 0. A link class's
    pull is that ridge up to about ``link_prior_scale`` (log: 0.25, 1.28x) and grows only logarithmically
    past it (``link_prior``): a link class is about right or far off (PCIe where the file says NVLink:
    10-40x; a network at a third of its rate), where a GPU class's compute rarely is beyond 1.6x. So a
    small slowdown that a slightly slower network or a slightly slower GPU could explain is not handed to a
    20x slower link (h100-l4-32's PCIe draw, 4% slower runs), a large one is not handed to 3.7x slower
    GPUs because the ridge preferred the smaller log change (three-gen-24's, a 3.2x slower ZeRO-3 run),
    and a network at 0.41x its rate is read as such after three runs, not as 1.22x slower A100s
    (a100-a10g-48's; at scale 0.5 it was not). experiments/RESULTS.md, "Structured lies".
    """

    simulator: object
    prior_weight: float = 0.2
    link_prior_scale: float = 0.25
    max_factor: float = 10.0
    max_link_factor: float = 100.0  # a link class may be far off: PCIe where the file says NVLink is 10-40x
    min_validation_runs: int = 3  # from this many runs on, a fit must beat the profile on held-out runs
    observations: list[_Observation] = field(default_factory=list)
    oom_runs: list[_Observation] = field(default_factory=list)  # runs that ran out of memory (memory only)
    corrections: Corrections = field(default_factory=Corrections)

    def __post_init__(self) -> None:
        self.cluster: ClusterSpec = self.simulator.cluster
        self.model: ModelSpec = self.simulator.model
        self.base_profile: CalibrationProfile = self.simulator.profile or default_profile(
            self.cluster, self.model.precision
        )
        self._profile = self.base_profile

    # ---------------------------------------------------------------------------------------------
    @property
    def profile(self) -> CalibrationProfile:
        """The base profile with the current corrections applied."""
        return self._profile

    def corrected_simulator(self):
        from autotune.simulator import Simulator

        return Simulator(self.cluster, self.model, self._profile)

    def update(self, config: ParallelConfig, measured: Measurement) -> CalibrationProfile:
        """Record one real run and refit. A run out of memory teaches the memory offsets only; other runs
        that did not finish (``status`` not ``ok``) are ignored."""
        if _timed(measured):
            runs = self.observations
        elif measured.oom or measured.status == "oom":
            runs = self.oom_runs
        else:
            return self._profile
        runs.append(_Observation(config, measured))
        try:
            self.refit()
        except Exception:
            runs.pop()  # a run the fit cannot take must not break every later refit too
            raise
        return self._profile

    @property
    def runs_seen(self) -> int:
        """Runs that moved the corrections: finished ones and those out of memory."""
        return len(self.observations) + len(self.oom_runs)

    def fit(self, pairs: list[tuple[ParallelConfig, Measurement]]) -> CalibrationProfile:
        """Record several runs at once and refit once."""
        for config, measured in pairs:
            if _timed(measured):
                self.observations.append(_Observation(config, measured))
        self.refit()
        return self._profile

    # ---------------------------------------------------------------------------------------------
    def _types_of(self, config: ParallelConfig) -> set[str]:
        return {self.cluster.device(d).name for d in config.devices}

    def refit(self) -> None:
        """Fit the factors to every run so far; keep them only if they predict unseen runs better.

        With ``min_validation_runs`` or more runs, each fit is first checked by cross-validation
        (``k = min(runs, 5)`` folds: fit on the other folds, predict this one): a correction that does
        not lower the held-out error of the uncorrected profile is dropped (time factors back to 1,
        memory offsets to 0), so a good measured profile is not bent to fit noise or a cost the factors
        cannot express. A held-out run whose GPU types or link classes no other fold measured cannot check
        them and does not vote; a memory offset of a device type seen in one fold only cannot be checked and is
        kept."""
        obs = self.observations
        if not obs:
            memory = self._oom_bounds(())
            self.corrections = replace(self.corrections, memory_GiB=memory)
            self._profile = apply_corrections(self.base_profile, self.cluster, self.corrections)
            return
        memory = self._fit_memory(obs)
        corr = self._fit_time(obs, memory)  # with the memory offsets: which plans fit decides feasibility
        k = min(len(obs), 5)
        if len(obs) >= self.min_validation_runs:
            time_err = {"fitted": 0.0, "base": 0.0}
            mem_err: dict[str, dict[str, float]] = {}
            base_sim = self._simulator_with(Corrections())
            for fold in range(k):
                train = [o for i, o in enumerate(obs) if i % k != fold]
                test = [o for i, o in enumerate(obs) if i % k == fold]
                offsets = self._fit_memory(train)
                sim = self._simulator_with(self._fit_time(train, offsets, start=corr))  # warm start: one descent
                seen = {t for t, _ in offsets}
                terms = {t for o in train for t in self._types_of(o.config)}
                terms |= set().union(*(link_classes(self.cluster, o.config) for o in train))
                for o in test:
                    pred, base = sim.evaluate(o.config), base_sim.evaluate(o.config)
                    # a run whose GPU types or link classes no other fold measured cannot validate them
                    if self._types_of(o.config) | link_classes(self.cluster, o.config) <= terms:
                        time_err["fitted"] += _log_error(pred, o.measured)
                        time_err["base"] += _log_error(base, o.measured)
                    for dev, gib in o.measured.peak_memory_GiB.items():
                        t = self.cluster.device(dev).name
                        if (
                            gib <= 0
                            or t not in seen
                            or dev not in pred.peak_memory_GiB
                            or dev not in base.peak_memory_GiB
                        ):
                            continue  # (a type no other fold saw has nothing to validate)
                        e = mem_err.setdefault(t, {"fitted": 0.0, "base": 0.0})
                        e["fitted"] += abs(pred.peak_memory_GiB[dev] - gib)
                        e["base"] += abs(base.peak_memory_GiB[dev] - gib)
            if time_err["fitted"] >= time_err["base"]:
                log.info(
                    "online calibration: time corrections %s do not predict held-out runs better "
                    "(%d-fold mean |log error| %.3f vs %.3f uncorrected); keeping the profile's times",
                    replace(corr, memory_GiB=()).to_dict(),
                    k,
                    time_err["fitted"] / len(obs),
                    time_err["base"] / len(obs),
                )
                corr = Corrections()
            kept = tuple((t, v) for t, v in memory if t not in mem_err or mem_err[t]["fitted"] < mem_err[t]["base"])
            if kept != memory:
                log.info(
                    "online calibration: memory offsets of %s do not predict held-out runs better; dropped",
                    sorted(t for t, _ in set(memory) - set(kept)),
                )
            memory = kept
        memory = self._oom_bounds(memory, corr)
        self.corrections = replace(corr, memory_GiB=memory)
        self._profile = apply_corrections(self.base_profile, self.cluster, self.corrections)
        log.info("online calibration from %d run(s): %s", len(obs), self.corrections.to_dict())

    def _simulator_with(self, corr: Corrections):
        from autotune.simulator import Simulator

        return Simulator(self.cluster, self.model, apply_corrections(self.base_profile, self.cluster, corr))

    def _fit_time(
        self, obs: list[_Observation], memory: tuple[tuple[str, float], ...] = (), start: Corrections | None = None
    ) -> Corrections:
        """Least-squares time factors (compute, contention, link) for ``obs``, with the memory offsets
        ``memory`` applied (returned with them). ``start``: begin the descent there (else from several
        contention levels)."""
        import numpy as np
        from scipy.optimize import least_squares

        types = sorted({t for o in obs for t in self._types_of(o.config)})
        multi_rank = any(len(o.config.devices) > 1 for o in obs)
        contention_types = [
            t for t in types if (d := self.base_profile.device(t)) is not None and d.contention and multi_rank
        ]
        classes = sorted(set().union(*(link_classes(self.cluster, o.config) for o in obs)))
        names = [f"compute:{t}" for t in types] + [f"contention:{t}" for t in contention_types]
        names += [f"link:{c}" for c in classes]
        lim = np.array([math.log(self.max_link_factor if n.startswith("link:") else self.max_factor) for n in names])
        links = np.array([n.startswith("link:") for n in names])

        def corrections(theta) -> Corrections:
            vals = dict(zip(names, (math.exp(x) for x in theta)))
            return Corrections(
                compute=tuple((t, vals[f"compute:{t}"]) for t in types),
                link=tuple((c, vals[f"link:{c}"]) for c in classes),
                contention=tuple((t, vals[f"contention:{t}"]) for t in contention_types),
                memory_GiB=memory,
            )

        def residuals(theta):
            res = run_residuals(self._simulator_with(corrections(theta)), obs)
            theta = np.asarray(theta)
            res.extend(self.prior_weight * np.where(links, link_prior(theta, self.link_prior_scale), theta))
            return np.asarray(res)

        # The shared-host bound is a max(): while it does not bind, the contention factor has no
        # gradient. Start from a few contention levels and keep the best fit. The same for the links: a
        # collective the schedule hides behind compute at the file's rate has no gradient there, though at
        # a tenth of it (PCIe where the file says NVLink) it sets the pace; so start from the links at
        # LINK_START too.
        if start is not None:
            given = {
                **{f"compute:{t}": v for t, v in start.compute},
                **{f"contention:{t}": v for t, v in start.contention},
                **{f"link:{c}": v for c, v in start.link},
            }
            inits = [np.clip(np.array([math.log(given.get(n, 1.0)) for n in names]), -lim, lim)]
        else:
            levels = [0.0] if not contention_types else [0.0, math.log(2.0), math.log(4.0)]
            slow = [0.0, math.log(LINK_START)] if classes else [0.0]
            inits = [
                np.array([c0 if n.startswith("contention:") else l0 if n.startswith("link:") else 0.0 for n in names])
                for c0 in levels
                for l0 in slow
            ]
        best = None
        for x0 in inits:
            fit = least_squares(residuals, x0, bounds=(-lim, lim), diff_step=1e-3, xtol=1e-6, ftol=1e-8)
            if best is None or fit.cost < best.cost - 1e-12:
                best = fit
        return corrections(best.x)

    def _oom_bounds(
        self, memory: tuple[tuple[str, float], ...], corr: Corrections | None = None
    ) -> tuple[tuple[str, float], ...]:
        """``memory`` offsets raised until every run that ran out of memory is predicted to (its fullest
        device's type, by the share of its memory predicted in use, over it by ``OOM_MARGIN_GiB``)."""
        offsets = dict(memory)
        for o in self.oom_runs:
            for _ in range(4):  # an offset replaces a default baseline it may exceed: a few steps close the gap
                sim = self._simulator_with(replace(corr or Corrections(), memory_GiB=tuple(sorted(offsets.items()))))
                pred = sim.evaluate(o.config)
                if pred.oom or not pred.peak_memory_GiB:
                    break  # explained (or the plan is invalid)
                peak = pred.peak_memory_GiB
                dev = max(peak, key=lambda d: peak[d] / self.cluster.device(d).memory_GiB)
                t = self.cluster.device(dev).name
                raise_by = self.cluster.device(dev).memory_GiB - peak[dev] + OOM_MARGIN_GiB
                offsets[t] = offsets.get(t, 0.0) + raise_by
                log.info("online calibration: %s ran out of memory for real: %s holds %.2f GiB less", dev, t, raise_by)
        return tuple(sorted(offsets.items()))

    def _fit_memory(self, obs: list[_Observation]) -> tuple[tuple[str, float], ...]:
        """Per device type, the mean of measured minus predicted peak memory (no time factor moves memory)."""
        sim = self._simulator_with(Corrections())
        diffs: dict[str, list[float]] = {}
        for o in obs:
            pred = sim.evaluate(o.config)
            for dev, gib in o.measured.peak_memory_GiB.items():
                if dev in pred.peak_memory_GiB and gib > 0:
                    diffs.setdefault(self.cluster.device(dev).name, []).append(gib - pred.peak_memory_GiB[dev])
        return tuple((t, sum(v) / len(v)) for t, v in sorted(diffs.items()))


def _log_error(pred: Measurement, measured: Measurement) -> float:
    """``|log(predicted / measured)|`` of the iteration time; a plan predicted infeasible counts 5."""
    if pred.status != "ok" or pred.iteration_time_s <= 0:
        return 5.0
    return abs(math.log(pred.iteration_time_s / measured.iteration_time_s))


class CalibratingEvaluator:
    """An evaluator (``evaluate(config) -> Measurement``) that passes every plan to ``inner`` (the real
    profiled run, ``runner.RealEvaluator``) and feeds each result to an ``OnlineCalibrator``, so that
    ``simulator`` is always the simulator corrected by every run so far. A search with
    ``--backend real`` wraps its real evaluator in this and screens candidates with ``.simulator``."""

    def __init__(self, inner, simulator) -> None:
        self.inner = inner
        self.cluster = inner.cluster
        self.model = inner.model
        self.calibrator = OnlineCalibrator(simulator)
        self._simulator = simulator
        self.start_simulator = simulator  # as the search began: no run's correction in it

    @property
    def simulator(self):
        return self._simulator

    def check(self, config: ParallelConfig) -> str | None:
        """The inner evaluator's own feasibility check, if it has one (see ``runner.RealEvaluator.check``)."""
        check = getattr(self.inner, "check", None)
        return check(config) if check is not None else None

    def evaluate(self, config: ParallelConfig) -> Measurement:
        measured = self.inner.evaluate(config)
        self.observe(config, measured)
        return measured

    def observe(self, config: ParallelConfig, measured: Measurement) -> None:
        """Refit the corrections with one measurement of ``config`` (``evaluate`` does this for its runs).
        A refit that raises is logged and leaves the correction as it was: the run happened, and its
        measurement is the caller's to keep."""
        before = self.calibrator.runs_seen
        try:
            self.calibrator.update(config, measured)
        except Exception as e:
            log.warning(
                "online calibration: could not refit with the run of %s (%s: %s); the correction stays as it was",
                config.describe(),
                type(e).__name__,
                e,
            )
            return
        if self.calibrator.runs_seen > before:
            self._simulator = self.calibrator.corrected_simulator()
