"""What the real runs so far say about the plans not run yet: a posterior over the simulator's errors.

A prediction is off by its terms' errors (``autotune.simulator.error_bar``): each GPU class's compute, the
network of each GPU class's nodes, the links inside each GPU class's nodes, and a common factor (the runner's
overheads, which move every plan alike). A plan's log iteration time is its predicted log time plus ``J @ z``:
``z`` the terms' log errors, ``J`` the plan's sensitivity to each (measured by simulating the plan with that
term stretched, so a term the schedule hides contributes little; a link class stretched 4x, its errors' size
when the cluster file is wrong). The prior of ``z`` is the error bars, a link class's at least ``LINK_PRIOR``; every
real run is one noisy linear observation of ``z`` (Gaussian conditioning), so a run on one plan moves the
prediction of every plan that shares its terms, by how much it shares them.

``CandidateTable`` holds the candidates' predictions, error bars, memory headroom and sensitivities (values
only: built once per search, ``candidate_table``); ``Posterior`` is the running belief. The learned chooser
of real runs (``envs.acquisition``) reads its mean and spread; ``expected_gain`` is the stopping rule's;
``teaching`` is what a run is expected to teach about the other plans (the ``gain and teaching`` rule's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autotune.planning.planner import Planner
from autotune.simulator.error_bar import compute_error, network_error
from autotune.simulator.perturbation import MEMORY_ERROR, ClusterErrors, perturb
from autotune.specs import NodeSpec, ParallelConfig

#: relative stretch of one term when measuring a plan's sensitivity to it
STRETCH = 0.25
#: the same for a link class (a network, the links inside one GPU class's nodes): links are off by far more
#: than compute when the cluster file is wrong (PCIe where it says NVLink: 10-20x; a shared or throttled
#: network: 2-3x), and a plan that hides its traffic behind compute at +25% may not at 4x, so the linear view
#: of a link's error is taken at 4x (at +25%, one 6x-slow run of a plan heavy on a PCIe node's links was read
#: as slow compute, and every plan sharing that compute looked 6x slow: experiments/RESULTS.md, "Structured lies")
LINK_STRETCH = 3.0
#: the least prior spread of a link class's log error: a wrong file's links are off by far more than the
#: simulator's network model on a right one (``error_bar.network_error``: 10-15%). Checked on the stopping
#: rule's validation realities (``experiments/quality/stop_rule.py``: 97 -> 98% reached, 0.3 more runs spent)
#: and on the structured lies (``policy_vs_rule.py``); 0.3 to 1.0 did alike there, 0.3 spends the fewest runs
LINK_PRIOR = 0.3
#: prior spread of the common factor (the runner's overheads, the framework: every plan alike)
COMMON_ERROR = 0.5
#: spread a run keeps that no term explains (run-to-run noise, the linearisation): the least assumed
RUN_NOISE = 0.05
#: the mean of max/min - 1 over two runs, in standard deviations of a run's log time (2 / sqrt(pi))
RANGE_OF_TWO = 2.0 / math.sqrt(math.pi)


def run_noise(median_spread: float | None) -> float:
    """The run-to-run spread (standard deviation of log time) the real runs showed: from the median
    ``max / min - 1`` of the plans run more than once (``autotune.search.screen.CalibrationScreen.median_spread``),
    never below ``RUN_NOISE``; ``RUN_NOISE`` before any plan ran twice (None; on this loaded machine's CPU
    ranks one plan's runs spread 2-36%)."""
    if median_spread is None:
        return RUN_NOISE
    return max(RUN_NOISE, math.log1p(max(median_spread, 0.0)) / RANGE_OF_TWO)


@dataclass(frozen=True, slots=True)
class CandidateTable:
    """The candidates of one search and what the nominal simulator says of them (arrays over candidates)."""

    configs: tuple[ParallelConfig, ...]  # () in a training set read back from arrays
    predicted_s: np.ndarray  # (K,) predicted iteration time
    expected_error: np.ndarray  # (K,) the prediction's error bar
    headroom: np.ndarray  # (K,) 1 - the fullest device's predicted peak / its usable memory
    sensitivity: np.ndarray  # (K, T) d log time / d log term
    prior_sigma: np.ndarray  # (T,) the terms' error bars
    terms: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.predicted_s)


@dataclass(frozen=True, slots=True)
class _Term:
    """One error term: its name, prior spread, the errors that stretch it, and by how much (``STRETCH`` for a
    class's compute, ``LINK_STRETCH`` for a link class)."""

    name: str
    prior_sigma: float
    errors: ClusterErrors
    stretch: float


def _link_term(name: str, nodes: list[NodeSpec], inside: bool) -> _Term:
    """The term of ``nodes``' links between nodes (``inside`` False) or inside each node: its prior spread
    the slowest link's network error, at least ``LINK_PRIOR``; stretched ``LINK_STRETCH``."""
    slowest = min((n.intra_node if inside else n.network).bandwidth_GBps for n in nodes)
    factor = {n.name: 1.0 / (1.0 + LINK_STRETCH) for n in nodes}
    errors = ClusterErrors(intra_node_bandwidth=factor) if inside else ClusterErrors(network_bandwidth=factor)
    return _Term(name, max(LINK_PRIOR, network_error(slowest)[0]), errors, LINK_STRETCH)


def _terms(cluster, precision: str, calibrated: frozenset[str]) -> list[_Term]:
    """Every term: each GPU class's compute, its nodes' network (several nodes), the links inside its nodes
    (several GPUs in a node: one node type may be PCIe where the file says NVLink)."""
    classes = list(dict.fromkeys(n.device.name for n in cluster.nodes))
    out = []
    for name in classes:
        sigma = compute_error(name, precision, name in calibrated)[0]
        out.append(_Term(f"compute on {name}", sigma, ClusterErrors(compute_time={name: 1.0 + STRETCH}), STRETCH))
    if len(cluster.nodes) > 1:  # one term per GPU class's nodes: their links may be off each their own way
        for name in classes:
            nodes = [n for n in cluster.nodes if n.device.name == name]
            out.append(_link_term(f"network of the {name} nodes", nodes, inside=False))
    for name in dict.fromkeys(n.device.name for n in cluster.nodes if n.count > 1):
        nodes = [n for n in cluster.nodes if n.device.name == name and n.count > 1]
        out.append(_link_term(f"links inside the {name} nodes", nodes, inside=True))
    return out


def candidate_table(
    cluster, model, configs: Sequence[ParallelConfig], simulator_factory, calibrated: frozenset[str] = frozenset()
) -> CandidateTable:
    """The table of ``configs`` that the nominal simulator says run, fastest predicted first:
    ``simulator_factory(cluster)`` gives
    a simulator of a cluster (the profile's, when the search has one); ``calibrated``: the GPU classes the
    profile measured (their smaller error bar)."""
    nominal = simulator_factory(cluster)
    ms = [nominal.evaluate(c) for c in configs]
    keep = sorted((i for i, m in enumerate(ms) if m.ok), key=lambda i: ms[i].iteration_time_s)  # fastest first
    configs = tuple(configs[i] for i in keep)
    ms = [ms[i] for i in keep]
    predicted = np.array([m.iteration_time_s for m in ms], dtype=float)
    terms = _terms(cluster, model.precision, calibrated)
    sens = np.ones((len(configs), len(terms) + 1))  # the common factor: every plan alike
    for t, term in enumerate(terms):
        sim = simulator_factory(perturb(cluster, term.errors))
        for i, c in enumerate(configs):
            m = sim.evaluate(c)
            stretched = m.iteration_time_s if m.ok else predicted[i]
            sens[i, t + 1] = max(0.0, math.log(stretched / predicted[i]) / math.log(1.0 + term.stretch))
    headroom = np.array([1.0 - nominal.memory_use(m) for m in ms], dtype=float)
    return CandidateTable(
        configs,
        predicted,
        np.array([m.expected_error for m in ms], dtype=float),
        headroom,
        sens,
        np.array([COMMON_ERROR] + [term.prior_sigma for term in terms], dtype=float),
        ("common",) + tuple(term.name for term in terms),
    )


def first_plans(space, sim, refused, limit: int, left_out: list | None = None) -> list[ParallelConfig]:
    """The structured planner's first ``limit`` plans for ``space``, costed by ``sim``, that ``refused``
    (config -> why, or None) lets through (it plans twice as many to fill them); the ones it refused before
    the last are appended to ``left_out`` when given."""
    out = []
    for cand in Planner(space, sim).plan(2 * limit):
        if refused(cand.config) is None:
            out.append(cand.config)
        elif left_out is not None:
            left_out.append(cand.config)
        if len(out) >= limit:
            break
    return out


#: a run farther than this many predictive standard deviations from what the belief expected is a surprise:
#: the error bars were too narrow for this cluster (``Posterior.doubt``)
SURPRISE_Z = 2.0
#: the most a surprise widens the terms' error bars (a factor on their prior spread)
MAX_DOUBT = 4.0
#: the spread added to a candidate's belief per unit of log shift the runs taught it (``Posterior._update``):
#: chosen on 132 structured-lie draws of the held-out tables (``experiments/quality/policy_vs_rule.py``: within
#: 2% of the true best after 10 runs 91 -> 95%, the same after 1-5) against the validation realities of the
#: stopping rule (``stop_rule.py``: 97% reached as before, 0.5 more runs spent); 0.5 spent 0.9 more there
EXTRAPOLATION = 0.25


class Posterior:
    """The belief over the terms' log errors after the real runs so far (module docstring).

    It doubts itself: a run outside ``SURPRISE_Z`` standard deviations of its predictive distribution widens
    every term's prior spread (``doubt``, by the surprise's size over ``SURPRISE_Z``, at most ``MAX_DOUBT``):
    wider beliefs, larger expected gains, a stopping rule that waits. ``explains`` says whether the belief
    accounts for every run so far (each within ``SURPRISE_Z`` of its posterior mean); a search stops only when it
    does (``autotune.search.agents.acquire``)."""

    def __init__(self, table: CandidateTable, noise: float = RUN_NOISE) -> None:
        self.table = table
        self.noise = noise
        self.doubt = 1.0
        self.run = np.zeros(len(table), dtype=bool)
        self.failed = np.zeros(len(table), dtype=bool)
        self.measured_s = np.full(len(table), np.nan)
        self._rows: list[int] = []
        self._update()

    def observe(self, index: int, measured_s: float | None) -> None:
        """Candidate ``index`` ran: its iteration time, or None when it did not run (out of memory, failed)."""
        self.run[index] = True
        if measured_s is None or not measured_s > 0:
            self.failed[index] = True
        else:
            z = abs(math.log(measured_s) - self.mean_log_s[index]) / self.std_log_s[index]
            if z > SURPRISE_Z:  # outside the bar: the bars were too narrow here
                self.doubt = min(MAX_DOUBT, max(self.doubt, self.doubt * z / SURPRISE_Z))
            self.measured_s[index] = measured_s
            self._rows.append(index)
        self._update()

    def _update(self) -> None:
        t = self.table
        prior = np.diag((self.doubt * t.prior_sigma) ** 2)
        if not self._rows:
            mean, cov = np.zeros(len(t.prior_sigma)), prior
        else:
            a = t.sensitivity[self._rows]
            y = np.log(self.measured_s[self._rows] / t.predicted_s[self._rows])
            s = a @ prior @ a.T + self.noise**2 * np.eye(len(self._rows))
            gain = prior @ a.T @ np.linalg.inv(s)
            mean, cov = gain @ y, prior - gain @ a @ prior
        self._cov = cov
        shift = t.sensitivity @ mean
        self.mean_log_s = np.log(t.predicted_s) + shift
        var = np.maximum(np.einsum("kt,ts,ks->k", t.sensitivity, cov, t.sensitivity), 0.0)
        self._fit_std = np.sqrt(var + self.noise**2)  # a run of it would also carry the run's own noise
        # a shift the runs taught is a linear extrapolation of each plan's sensitivity (measured at +STRETCH, a
        # link's at +LINK_STRETCH): far from it a plan may hide the slow term (collectives behind compute) or
        # not; that much more doubt
        self.std_log_s = np.sqrt(self._fit_std**2 + (EXTRAPOLATION * shift) ** 2)

    def set_noise(self, noise: float) -> None:
        """The run-to-run noise the runs so far showed (``run_noise``): the belief conditioned again."""
        if noise != self.noise:
            self.noise = noise
            self._update()

    def explains(self) -> bool:
        """Whether every run so far lies within ``SURPRISE_Z`` standard deviations of the belief's mean for it."""
        rows = np.array(self._rows, dtype=int)
        if not rows.size:
            return True
        residual = np.abs(np.log(self.measured_s[rows]) - self.mean_log_s[rows])
        return bool((residual <= SURPRISE_Z * self._fit_std[rows]).all())

    def largest_gain(self) -> float:
        """The largest expected gain of a run not made yet, times its chance to fit in memory."""
        return float((self.expected_gain() * self.fit_probability()).max())

    def settled(self, stop_gain: float) -> bool:
        """The stopping rule (``autotune.search.agents.acquire``): a plan ran, no candidate is expected to beat
        the best measured one by ``stop_gain``, and the belief explains every run so far."""
        return self.best_measured_s is not None and self.largest_gain() < stop_gain and self.explains()

    def first_not_run(self) -> int:
        """The candidate not run yet that comes first in the table (its order: the simulator's)."""
        return int(np.flatnonzero(~self.run)[0])

    @property
    def best_measured_s(self) -> float | None:
        ok = self.measured_s[~np.isnan(self.measured_s)]
        return float(ok.min()) if ok.size else None

    def fit_probability(self) -> np.ndarray:
        """Per candidate, the chance it fits in memory when the usable memory is off by ``MEMORY_ERROR``."""
        used = np.clip(1.0 - self.table.headroom, 1e-6, None)
        return _normal_cdf(-np.log(used) / MEMORY_ERROR)

    def expected_gain(self) -> np.ndarray:
        """Per candidate, E[max(0, log best measured - log time)]: the expected log-time improvement of
        running it (0 for a run candidate; against the best posterior mean before any run)."""
        best = self.best_measured_s
        ref = math.log(best) if best is not None else float(self.mean_log_s.min())
        z = (ref - self.mean_log_s) / self.std_log_s
        phi = np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
        gain = (ref - self.mean_log_s) * _normal_cdf(z) + self.std_log_s * phi
        return np.where(self.run, 0.0, np.maximum(gain, 0.0))

    def teaching(self) -> np.ndarray:
        """Per candidate not run, what its run is expected to teach about the others (the knowledge gradient,
        in log time): how much lower the best believed plan's time is expected to lie once its run is seen.
        A run moves the terms it shares with other plans (``_update``): its surprise ``xi`` (standard normal)
        shifts candidate ``j``'s mean by ``c_j xi``, ``c_j`` their shared variance over its predictive spread,
        so the value is ``min_j mu_j - E[min_j (mu_j + c_j xi)]`` over the plans that may fit (their chance
        to fit at least one half), measured plans at their measured time. A plan whose run separates terms the
        runs so far could not tell apart (a one-node plan beside a network-bound one) teaches much even when
        it cannot win itself; ``expected_gain`` sees only its own chance to win. 0 for a run candidate."""
        t = self.table
        fits = (self.fit_probability() >= 0.5) & ~self.failed
        measured = ~np.isnan(self.measured_s)
        mu = self.mean_log_s.copy()
        mu[measured] = np.log(self.measured_s[measured])
        mu[~fits] = np.inf
        if not np.isfinite(mu).any():
            return np.zeros(len(t))
        shared = t.sensitivity @ self._cov @ t.sensitivity.T  # (K, K) covariance of the plans' log shifts
        pred = np.sqrt(np.maximum(np.diag(shared), 0.0) + self.noise**2)
        slope = shared / pred[None, :]  # column i: each plan's shift per unit surprise of plan i's run
        slope[measured] = 0.0  # a measured plan keeps its measured time
        best = mu.min()
        # (Q, K candidates run, K believed): the best belief after run i's surprise xi_q
        after = (mu[None, None, :] + _XI[:, None, None] * slope.T[None, :, :]).min(axis=2)
        value = best - _XI_WEIGHT @ after
        return np.where(self.run | ~fits, 0.0, np.maximum(value, 0.0))


#: the expectation over a run's surprise (standard normal) in ``Posterior.teaching``: probabilists' Gauss-Hermite
#: nodes and weights, 24 points
_XI, _XI_WEIGHT = np.polynomial.hermite_e.hermegauss(24)
_XI_WEIGHT = _XI_WEIGHT / _XI_WEIGHT.sum()


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2)))
