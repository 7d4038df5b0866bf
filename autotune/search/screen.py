"""Closing the loop for ``--backend real``: real runs correct the simulator, the corrected simulator
screens the plans the agent asks for next.

``CalibrationScreen`` is both halves, for any method:

- the evaluator ``BudgetedEvaluator`` calls for a real run: it wraps the real evaluator in
  ``autotune.calibration.online.CalibratingEvaluator``, so every real run refits the correction
  factors, and it keeps the corrected simulator's prediction error *before* each run;
- the memory model ``BudgetedEvaluator`` asks before anything else (``memory_check``): the corrected
  simulator's, from the first plan on (memory first: a plan it says does not fit is never run);
- the ``screen`` ``BudgetedEvaluator`` asks before a real run: once ``min_real_runs`` real runs have
  fitted the corrections, a plan is pruned (answered with the corrected prediction, status
  ``"pruned"``, score 0, no budget spent) when the corrected simulator predicts it runs out of
  memory, or predicts it slower than ``keep_fraction`` of the best measured plan. The comparison is
  prediction against prediction (``predicted(P) < keep_fraction * predicted(best)``), so a
  simulator that is off by a common factor still ranks plans correctly. A plan is screened for speed
  only when every device type it uses has been in a real run (an uncalibrated type's speed is still
  the profile's guess, possibly off by far more than a common factor).

Noisy real runs (a loaded machine's step times move by 15-40% between runs): when a run disagrees with
the corrected simulator's prediction by more than the noise seen so far explains, the plan is measured
again, and a third time when those two runs disagree by more than that noise; the plan's measurement is
then the median run, and the spread of its runs feeds the noise estimate (``RealRun``, ``noise``).
Repeats of one plan are not new plans: they do not count against ``--budget``. Each real run is logged
(predicted vs measured, the error, the runs and their spread) and kept in ``reports``.

``keep_fraction = 0.5`` (default) keeps every plan the corrected simulator puts within 2x of the best
measured one: the fidelity experiment's worst time error after a few runs is well below that, so a
plan pruned on speed is very unlikely to have been the best.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from autotune.errors import SpecError
from autotune.planning.budget import PRUNED, BudgetedEvaluator, Evaluation
from autotune.specs import Measurement, ParallelConfig

log = logging.getLogger(__name__)

MIN_REAL_RUNS = 2
KEEP_FRACTION = 0.5
#: the run-to-run spread assumed before two runs of one plan were seen (relative, max/min - 1)
DEFAULT_NOISE = 0.10
#: runs of one plan at most (the first and up to two repeats)
MAX_RUNS = 3


@dataclass(frozen=True, slots=True)
class PredictionError:
    """The corrected simulator's error on one real run, predicted before the run (fractions)."""

    config: ParallelConfig
    time_error: float  # |predicted - measured| / measured iteration time
    memory_error: float | None  # mean over devices of |predicted - measured| / measured peak memory


@dataclass(frozen=True, slots=True)
class RealRun:
    """What one plan's real run(s) gave against the corrected simulator's prediction before them."""

    index: int  # 1, 2, ... in the order the plans were run
    config: ParallelConfig
    predicted_s: float | None  # the corrected simulator's iteration time before the run (None: no prediction)
    measured_s: float  # the plan's measured iteration time (the median of its runs), 0 when it did not run
    runs_s: tuple[float, ...]  # every run's iteration time
    status: str

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured, signed."""
        if self.predicted_s is None or self.measured_s <= 0:
            return None
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def spread(self) -> float | None:
        """max / min - 1 over the plan's runs (None with one run)."""
        ok = [t for t in self.runs_s if t > 0]
        return max(ok) / min(ok) - 1.0 if len(ok) > 1 else None

    def line(self) -> str:
        err = f"{100 * self.error:+.1f}%" if self.error is not None else "-"
        pred = f"{self.predicted_s:.3f} s" if self.predicted_s is not None else "-"
        runs = "" if len(self.runs_s) == 1 else f", {len(self.runs_s)} runs spread {100 * self.spread:.0f}%"
        if self.status != "ok":
            return f"real run {self.index}: {self.status}, predicted {pred}"
        return f"real run {self.index}: predicted {pred}, measured {self.measured_s:.3f} s (simulator {err}{runs})"

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "predicted_s": self.predicted_s,
            "measured_s": self.measured_s,
            "runs_s": list(self.runs_s),
            "status": self.status,
            "config": self.config.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> RealRun:
        return cls(
            int(d["index"]),
            ParallelConfig.from_dict(d["config"], source="real run"),
            None if d.get("predicted_s") is None else float(d["predicted_s"]),
            float(d["measured_s"]),
            tuple(float(t) for t in d.get("runs_s", ())),
            str(d.get("status", "ok")),
        )


def real_run_summary(reports: list[RealRun] | tuple[RealRun, ...]) -> str:
    """One line on the simulator's error over the real runs and their noise (empty without real runs)."""
    errors = [abs(r.error) for r in reports if r.error is not None]
    if not errors:
        return ""
    spreads = [r.spread for r in reports if r.spread is not None]
    noise = (
        f"; {len(spreads)} plans measured again, run-to-run spread {100 * min(spreads):.0f}-{100 * max(spreads):.0f}%"
        if spreads
        else ""
    )
    return (
        f"simulator error before each real run (corrected by the runs before it): mean "
        f"{100 * sum(errors) / len(errors):.1f}%, max {100 * max(errors):.1f}% over {len(errors)} runs{noise}"
    )


class CalibrationScreen:
    """``evaluate`` (real run + online calibration) and ``screen`` (prune by corrected prediction).

    ``real`` is the real evaluator (``runner.RealEvaluator``, or any evaluator standing in for it);
    ``simulator`` the starting simulator (``Simulator(cluster, model, profile)``)."""

    def __init__(
        self, real, simulator, min_real_runs: int = MIN_REAL_RUNS, keep_fraction: float = KEEP_FRACTION
    ) -> None:
        from autotune.calibration.online import CalibratingEvaluator

        if not 0.0 <= keep_fraction <= 1.0:
            from autotune.errors import SpecError

            raise SpecError("search", "keep_fraction", f"must be in [0, 1], got {keep_fraction}")
        self.calibrating = CalibratingEvaluator(real, simulator)
        self.cluster = real.cluster
        self.model = real.model
        self.min_real_runs = min_real_runs
        self.keep_fraction = keep_fraction
        self.real_runs: list[ParallelConfig] = []  # every plan handed to the real evaluator, in order
        self.errors: dict[ParallelConfig, PredictionError] = {}
        self.reports: list[RealRun] = []  # one per plan run for real, in order
        self.spreads: list[float] = []  # run-to-run spread of each plan measured more than once

    @property
    def simulator(self):
        """The simulator corrected by every real run so far."""
        return self.calibrating.simulator

    @property
    def start_simulator(self):
        """The simulator the search began with (the profile's, no run's correction)."""
        return self.calibrating.start_simulator

    @property
    def calibrator(self):
        return self.calibrating.calibrator

    # -- memory first ------------------------------------------------------------------------------
    def memory_check(self, config: ParallelConfig) -> Measurement | None:
        """The corrected simulator's memory model (``Simulator.memory_check``), asked by
        ``BudgetedEvaluator`` before every new plan from the first one on: a plan it says does not fit
        is answered ``oom`` without a real run (the memory offsets it has fitted so far included)."""
        return self.simulator.memory_check(config)

    def memory_use(self, measurement: Measurement) -> float:
        return self.simulator.memory_use(measurement)

    # -- the real run ------------------------------------------------------------------------------
    def check(self, config: ParallelConfig) -> str | None:
        """The real evaluator's own feasibility check (``runner.RealEvaluator.check``), if it has one: a
        plan the runner cannot run is invalid before any screening or real run."""
        return self.calibrating.check(config)

    @property
    def median_spread(self) -> float | None:
        """The run-to-run spread seen so far: the median over plans measured more than once (None: none)."""
        if not self.spreads:
            return None
        ordered = sorted(self.spreads)
        return ordered[len(ordered) // 2]

    @property
    def noise(self) -> float:
        """``median_spread``, else ``DEFAULT_NOISE``."""
        spread = self.median_spread
        return DEFAULT_NOISE if spread is None else spread

    def evaluate(self, config: ParallelConfig) -> Measurement:
        try:
            predicted = self.simulator.evaluate(config)
        except Exception as e:  # the prediction is only for the record
            log.warning("no prediction for %s: %s", config.describe(), e)
            predicted = None
        self.real_runs.append(config)
        runs = self._runs(config, predicted)
        ok = sorted((m for m in runs if m.ok and m.iteration_time_s > 0), key=lambda m: m.iteration_time_s)
        measured = ok[len(ok) // 2] if ok else runs[0]
        if len(ok) > 1:
            self.spreads.append(ok[-1].iteration_time_s / ok[0].iteration_time_s - 1.0)
        self.calibrating.observe(config, measured)
        if predicted is not None and predicted.ok and measured.ok and measured.iteration_time_s > 0:
            t = abs(predicted.iteration_time_s - measured.iteration_time_s) / measured.iteration_time_s
            mem = [
                abs(predicted.peak_memory_GiB[d] - g) / g
                for d, g in measured.peak_memory_GiB.items()
                if g > 0 and d in predicted.peak_memory_GiB
            ]
            self.errors[config] = PredictionError(config, t, sum(mem) / len(mem) if mem else None)
        report = RealRun(
            len(self.reports) + 1,
            config,
            predicted.iteration_time_s if predicted is not None and predicted.ok else None,
            measured.iteration_time_s if measured.ok else 0.0,
            tuple(m.iteration_time_s for m in runs),
            "ok" if measured.ok else measured.status if not measured.oom else "oom",
        )
        self.reports.append(report)
        log.info("%s", report.line())
        return measured

    def _runs(self, config: ParallelConfig, predicted: Measurement | None) -> list[Measurement]:
        """The plan's real runs: one; a second when it disagrees with the prediction by more than twice the
        noise seen (and 10%); a third when those two disagree by more than twice the noise (and 5%)."""
        real = self.calibrating.inner
        runs = [real.evaluate(config)]
        first = runs[0]
        if not (first.ok and predicted is not None and predicted.ok and first.iteration_time_s > 0):
            return runs
        error = abs(predicted.iteration_time_s - first.iteration_time_s) / first.iteration_time_s
        if error <= max(0.10, 2 * self.noise):
            return runs
        runs.append(real.evaluate(config))
        times = [m.iteration_time_s for m in runs if m.ok and m.iteration_time_s > 0]
        if len(times) == 2 and max(times) / min(times) - 1.0 > max(0.05, 2 * self.noise) and len(runs) < MAX_RUNS:
            runs.append(real.evaluate(config))
        return runs

    # -- the screen --------------------------------------------------------------------------------
    def screen(self, config: ParallelConfig, best: Evaluation | None) -> Measurement | None:
        """The pruned answer for ``config``, or None to run it for real."""
        if len(self.calibrator.observations) < self.min_real_runs:
            return None
        sim = self.simulator
        try:
            pred = sim.evaluate(config)
        except Exception as e:
            log.warning("screen: no prediction for %s (%s); running it", config.describe(), e)
            return None
        if pred.oom:
            reason = "screened out: the corrected simulator predicts out of memory"
        elif not pred.ok:
            return None  # the simulator cannot judge it; the real run will
        else:
            if best is None or not best.measurement.ok:
                return None
            seen = {self.cluster.device(d).name for o in self.calibrator.observations for d in o.config.devices}
            if not {self.cluster.device(d).name for d in config.devices} <= seen:
                return None  # a device type no real run has calibrated yet: its speed is the profile's guess
            ref = sim.evaluate(best.config)
            if not ref.ok or ref.tokens_per_s <= 0:
                return None
            ratio = pred.tokens_per_s / ref.tokens_per_s
            if ratio >= self.keep_fraction:
                return None
            reason = (
                f"screened out: predicted {ratio:.2f} x the best measured plan's predicted throughput "
                f"(keep >= {self.keep_fraction})"
            )
        log.info("%s: %s", reason, config.describe())
        return replace(pred, oom=False, timeline=(), status=PRUNED, error=reason)


# --------------------------------------------------------------------------------------------------
# The closed loop's record in MLflow

CALIBRATED_PROFILE_ARTIFACT = "calibrated_profile.json"
CORRECTIONS_ARTIFACT = "calibration_corrections.json"


def log_prediction_error(tracker, screen, ev: Evaluation) -> None:
    """Parent metrics: the corrected simulator's error on this real run, predicted before it."""
    err = screen.errors.get(ev.config)
    if err is None or ev.measurement.status == PRUNED:
        return
    metrics = {"calibration_time_error": err.time_error}
    if err.memory_error is not None:
        metrics["calibration_memory_error"] = err.memory_error
    tracker.log_parent_metrics(metrics, step=ev.index)


def log_calibration(tracker, screen, budgeted: BudgetedEvaluator) -> None:
    """Parent: the number of screened-out plans, the fitted corrections and the corrected profile."""
    import re
    import tempfile

    from autotune.profile import CalibrationProfile
    from autotune.search.tracking import config_key

    try:
        corr = screen.calibrator.corrections
        pruned = len(budgeted.screened) - budgeted.memory_screened  # by the calibration screen
        metrics = {
            "pruned_plans": float(pruned),
            "real_runs": float(len(screen.real_runs)),
        }
        for kind, pairs in (
            ("link", corr.link),
            ("compute", corr.compute),
            ("contention", corr.contention),
            ("memory_GiB", corr.memory_GiB),
        ):
            for dev, v in pairs:
                metrics[f"calibration_{kind}_{re.sub(r'[^A-Za-z0-9_.-]', '_', dev)}"] = float(v)
        tracker.log_parent_metrics(metrics, step=0)
        doc = {
            "corrections": corr.to_dict(),
            "fitted_from_runs": len(screen.calibrator.observations),
            "real_runs": [config_key(c) for c in screen.real_runs],
            "pruned_plans": pruned,
            "memory_screened": budgeted.memory_screened,
            "min_real_runs": screen.min_real_runs,
            "keep_fraction": screen.keep_fraction,
        }
        profile = screen.calibrator.profile
        try:  # never log a profile that `--profile` would refuse to load
            CalibrationProfile.from_dict(json.loads(json.dumps(profile.to_dict())), source=CALIBRATED_PROFILE_ARTIFACT)
        except SpecError as e:
            log.warning(
                "the corrected profile is not a valid profile file (%s); %s not logged", e, CALIBRATED_PROFILE_ARTIFACT
            )
            doc["profile_error"] = str(e)
            profile = None
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / CORRECTIONS_ARTIFACT).write_text(json.dumps(doc, indent=2) + "\n")
            tracker.log_parent_artifact(Path(tmp) / CORRECTIONS_ARTIFACT)
            if profile is not None:
                profile.save(Path(tmp) / CALIBRATED_PROFILE_ARTIFACT)
                tracker.log_parent_artifact(Path(tmp) / CALIBRATED_PROFILE_ARTIFACT)
    except Exception as e:  # the record of the calibration must not lose the search's result
        log.warning("could not log the online calibration to MLflow: %s", e)
