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


@dataclass(frozen=True, slots=True)
class PredictionError:
    """The corrected simulator's error on one real run, predicted before the run (fractions)."""

    config: ParallelConfig
    time_error: float  # |predicted - measured| / measured iteration time
    memory_error: float | None  # mean over devices of |predicted - measured| / measured peak memory


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

    @property
    def simulator(self):
        """The simulator corrected by every real run so far."""
        return self.calibrating.simulator

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

    def evaluate(self, config: ParallelConfig) -> Measurement:
        try:
            predicted = self.simulator.evaluate(config)
        except Exception as e:  # the prediction is only for the record
            log.warning("no prediction for %s: %s", config.describe(), e)
            predicted = None
        self.real_runs.append(config)
        measured = self.calibrating.evaluate(config)
        if predicted is not None and predicted.ok and measured.ok and measured.iteration_time_s > 0:
            t = abs(predicted.iteration_time_s - measured.iteration_time_s) / measured.iteration_time_s
            mem = [
                abs(predicted.peak_memory_GiB[d] - g) / g
                for d, g in measured.peak_memory_GiB.items()
                if g > 0 and d in predicted.peak_memory_GiB
            ]
            self.errors[config] = PredictionError(config, t, sum(mem) / len(mem) if mem else None)
        return measured

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
            "calibration_link_factor": corr.link,
        }
        for kind, pairs in (
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
