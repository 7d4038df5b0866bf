"""``rl``: the learned chooser of which candidate plan to evaluate next (``envs.acquisition``), on real runs
and, with the simulator as "reality", on ``--backend sim``.

The planner's candidates (at most ``MAX_CANDIDATES``, within every limit the search keeps) are predicted by
the nominal simulator (the profile's, when the search has one) with their error bars and sensitivities
(``autotune.planning.posterior.candidate_table``). Before each run the policy (MaskablePPO, trained offline
across scenarios with the simulator's errors randomised: ``scripts/train_acquisition.py``, shipped as
``autotune/data/acquisition.safetensors``) picks the next candidate from the posterior every run so far
refitted (the first run is the planner's first plan, as every method's); the run goes through the search's
``BudgetedEvaluator`` like any method's. After every run from the first measured
one on, the candidates are re-planned with the simulator the closed loop corrected with the runs so far (the
plans its planner puts first, over the whole space, join the table; what ran stays, its measurements kept) and
predicted by it, with the starting simulator's error bars: a simulator far off on this cluster ranks plans the corrected one would never put in its first 64, and
its predictions can be far enough off that the posterior's linear view of the errors around them fails (on this
machine's CPU ranks the datasheet simulator predicts every candidate of a tiny model alike, floored by the host's
per-layer cost, while the runs differ 2x: experiments/RESULTS.md, "Real runs on this machine's CPU ranks"); the
posterior then starts again around the corrected predictions, and the run that corrected them is its first
observation. The closed loop's speed
screen (``autotune.search.screen``: a plan the corrected simulator puts below half the best is not run) is off
while it chooses: it would overrule the chooser's exploration with the very simulator the runs correct (the
memory model still screens, and every run still refits the correction).

On ``--backend sim`` the measured time is the prediction itself: the posterior learns nothing a prediction
did not say, there is no re-planning (no corrected simulator) and the search ends when every candidate has
been evaluated or the budget is spent (it replaced the local-move walk of ``--method rl``, whose pretrained
policy added nothing measurable over the planner's plans on the held-out scenarios: experiments/RESULTS.md).

Stopping rule (``stop_gain``, on by default for ``--backend real``): once a plan ran, the search stops when
no candidate left is expected to beat the best measured plan by ``STOP_GAIN`` (``Posterior.expected_gain``
times its chance to fit in memory) and the posterior explains every run it has seen (a run outside its error
bar widens the bars first: ``Posterior.doubt``), and says so; ``--budget`` stays the cap. The posterior takes a run to
be as noisy as the plans run more than once showed (``posterior.run_noise``; the closed loop repeats a plan
whose run disagrees with its prediction). Plans already evaluated (a
resumed search) are candidates too, read back free, and inform the posterior.
"""

from __future__ import annotations

import logging
from pathlib import Path

from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.posterior import Posterior, candidate_table, first_plans, run_noise
from autotune.planning.space import SearchSpace
from autotune.search.agents.rl import SCRATCH
from autotune.specs import ParallelConfig

log = logging.getLogger(__name__)

#: stop when no candidate is expected to shorten the best measured iteration by this much (log time): the
#: largest threshold that reaches 98% of the true best within 10 runs as often as never stopping, on the
#: validation realities (experiments/quality/stop_rule.py: 94% of 239 draws, 8.1 runs spent of 10; at 1%:
#: 91%, 5.5 runs)
STOP_GAIN = 0.001
#: ``policy_path`` meaning "no learned policy: the greedy expected gain of the posterior" (an ablation)
GREEDY = "greedy-gain"


def default_acquisition_path() -> Path:
    return Path(__file__).resolve().parents[2] / "data" / "acquisition.safetensors"


def policy_for(policy: str | Path | None) -> Path:
    """The policy file ``rl`` reads: ``policy``, else the shipped chooser's."""
    return Path(policy) if policy is not None else default_acquisition_path()


def uses_acquisition(policy: str | Path | None) -> bool:
    """True when ``rl`` runs this module's chooser: always, except ``--policy scratch`` (online learning on
    ``autotune/ParallelConfig-v0``, ``autotune.search.agents.rl``)."""
    return str(policy) != SCRATCH


def run_acquire(
    space: SearchSpace,
    budgeted: BudgetedEvaluator,
    seed: int = 0,
    policy_path: str | Path | None = None,
    stop_gain: float | None = None,
) -> str:
    """Spend ``budgeted`` on the candidates the policy picks (module docstring); returns why it stopped."""
    from autotune.planning.planner import simulator_of
    from autotune.simulator import Simulator
    from envs.acquisition import MAX_CANDIDATES

    # the simulator the search began with: its profile alone says which classes were measured (a corrected
    # profile would pass for a measured one, with a measured one's small error bars)
    sim = getattr(budgeted.inner, "start_simulator", None) or simulator_of(budgeted)
    profile = sim.profile if sim is not None else None
    calibrated = frozenset(
        n.device.name for n in space.cluster.nodes if profile is not None and profile.device(n.device.name)
    )
    engine = sim.engine if sim is not None else None  # the engine whose plans the search predicts
    nominal = Simulator(space.cluster, space.model, profile=profile, engine=engine)

    reported: set[ParallelConfig] = set()

    def table_from(planner_sim):
        """The table of what already ran (a start plan, a resumed search: its measurements inform the rest)
        and the plans ``planner_sim``'s planner puts first, predicted by ``planner_sim`` with the error bars of
        the search's starting simulator."""
        ran = list(dict.fromkeys(ev.config for ev in budgeted.history))[: MAX_CANDIDATES // 2]
        left_out: list = []
        planned = first_plans(space, planner_sim, budgeted.refusal, MAX_CANDIDATES, left_out)
        for config in left_out:  # an invalid proposal, free: the search says what it left out (once each)
            if config not in reported:
                reported.add(config)
                budgeted.evaluate(config)
        configs = ran + [c for c in planned if c not in ran]
        return candidate_table(
            space.cluster,
            space.model,
            configs[:MAX_CANDIDATES],
            lambda c: Simulator(c, space.model, profile=planner_sim.profile, engine=engine),
            calibrated,
        )

    def replan():
        """The table of the plans the simulator corrected by the runs so far puts first (the closed loop's,
        ``autotune.search.screen``), or None when there is none (the simulator backend)."""
        corrected = simulator_of(budgeted)
        return table_from(corrected) if corrected is not None and corrected is not sim else None

    table = table_from(nominal)
    if not len(table):
        return "no candidate plan fits the simulator's memory model"
    choose = _chooser(policy_path)
    screen, budgeted.screen = budgeted.screen, None  # the chooser decides what runs (the memory model still screens)
    try:
        return _spend(budgeted, table, choose, stop_gain, replan)
    finally:
        budgeted.screen = screen


def _posterior(table, budgeted: BudgetedEvaluator) -> Posterior:
    """The posterior of ``table`` given the plans of it already run (read back free)."""
    post = Posterior(table)
    for i, c in enumerate(table.configs):
        if c in budgeted:
            _observe(post, i, budgeted.evaluate(c))
    return post


def _spend(budgeted: BudgetedEvaluator, table, choose, stop_gain: float | None, replan) -> str:
    space = budgeted.space
    post = _posterior(table, budgeted)
    planned_after = 0  # the runs the table was last planned after
    while True:
        if budgeted.exhausted:  # before re-planning: nothing more will run
            reason = f"the budget of {budgeted.budget} runs is spent"
            break
        # after every run once one measured: the closed loop refitted the correction with it, and the
        # corrected simulator's planner may put first a plan the table never held (the whole space, its
        # families): the table becomes those plans and what ran, the posterior restarts around them
        if post.best_measured_s is not None and len(budgeted.history) > planned_after:
            planned_after = len(budgeted.history)
            fresh = replan()
            if fresh is not None and len(fresh):
                table, post = fresh, _posterior(fresh, budgeted)
        post.set_noise(run_noise(getattr(budgeted.inner, "median_spread", None)))  # as noisy as the runs showed
        if post.run.all():
            reason = f"every one of the {len(table)} candidate plans ran"
            break
        if stop_gain is not None and post.settled(stop_gain):  # the gain is small and the runs are explained
            reason = (
                f"no plan left is expected to beat the best measured one by {stop_gain:.1%} "
                f"(largest expected gain {post.largest_gain():.2%})"
            )
            break
        # the first run is the planner's first plan, as every other method's: with nothing measured there is
        # nothing to learn from yet, and that plan is most often the best (perturbed_reality.py: the policy's
        # own first pick reached 98% of the true best in 24% of draws, the planner's first plan in 31%)
        i = post.first_not_run() if not post.run.any() else choose(post, int(post.run.sum()), budgeted.budget)
        config = table.configs[i]
        params = {**space.encode(config), "acquisition_rank": i, "predicted_s": round(float(table.predicted_s[i]), 6)}
        _observe(post, i, budgeted.evaluate(config, params))
    log.info("real runs stopped after %d of %d: %s", budgeted.used, budgeted.budget, reason)
    if reason and not budgeted.exhausted:
        budgeted.ended = reason
    return reason


def _observe(post: Posterior, i: int, m) -> None:
    post.observe(i, m.iteration_time_s if m.ok else None)  # out of memory, failed or screened: no time


def _chooser(policy_path):
    from autotune.policy.acquisition_training import greedy_gain, policy_chooser

    if str(policy_path) == GREEDY:
        return greedy_gain
    from autotune.policy.policy_file import load_policy_network

    return policy_chooser(load_policy_network(policy_path or default_acquisition_path()))
