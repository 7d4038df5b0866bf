"""The learned chooser against its fixed rule on structured lies, in the chooser's own setting (issue 45, item 6).

The chooser of real runs (``--method rl --backend real``) picks among the planner's candidates using a
posterior over their times (``envs.acquisition``); its fixed rule (``--policy greedy-gain``) runs the
candidate of largest expected gain times its chance to fit; ``gain + teach`` adds what the run is expected to
teach about the other plans (``Posterior.teaching``, issue 45 item 2). Here both replay (with the simulator's order
beside them) on realities where the cluster file lies the way users get it wrong
(``autotune.simulator.perturbation.structured_lie``: network x 0.3-0.6, one GPU class slower, one class
with less usable memory, one node type on PCIe, network latency x 5-20, two at once), on the held-out
scenarios: each draw's table is the planner's candidates within the runner's limits, its truth their times
on the lying cluster's twin (NaN where a plan does not fit there). The first run is the planner's first plan
and the chooser stops at ``STOP_GAIN``, as a search does. No closed-loop correction and no re-plan: this is
the table the policy chooses from, so it isolates the choice itself (``perturbed_reality.py --lies
structured`` runs the whole search, minutes per draw).

Prints, per lie kind and over all draws: the share within 2% of the true best (of the table) after 1 / 2 /
3 / 5 / 10 runs, the mean best found over the true best, runs spent, and on how many draws the agent's runs
differ from the rule's; the same over the draws whose lie changes which candidate is best ("changed").

    nice -n 5 .venv/bin/python experiments/quality/policy_vs_rule.py [--draws 6] [--budget 10]
"""

from __future__ import annotations

import argparse
import logging
import math
import time

import numpy as np

BUDGETS = (1, 2, 3, 5, 10)


def episodes(draws: int, only: set[str] | None) -> list[tuple[str, str, object, bool]]:
    """(scenario, lie kind, episode, whether the lie changes the table's best) per draw."""
    from autotune.planning.posterior import candidate_table
    from autotune.policy.acquisition_training import TARGET, scenario_candidates
    from autotune.policy.scenarios import heldout_scenarios
    from autotune.simulator import Simulator
    from autotune.simulator.perturbation import LIE_KINDS, perturb, structured_lie
    from envs.acquisition import Episode

    out = []
    for i, s in enumerate(heldout_scenarios()):
        if only and s.name not in only:
            continue
        cluster, model = s.cluster, s.model
        table = candidate_table(cluster, model, scenario_candidates(cluster, model), lambda c: Simulator(c, model))
        if not len(table):
            print(f"{s.name}: no candidate within the runner's limits", flush=True)
            continue
        rng = np.random.default_rng([45, i])
        for d in range(draws):
            kind = LIE_KINDS[d % len(LIE_KINDS)]
            real = Simulator(perturb(cluster, structured_lie(cluster, kind, rng)), model)
            measured = [real.evaluate(c) for c in table.configs]
            truth = np.array([m.iteration_time_s if m.ok else math.nan for m in measured])
            if np.isnan(truth).all():
                continue
            nominal_best = int(np.nanargmin(table.predicted_s))
            changed = not (truth[nominal_best] <= np.nanmin(truth) / TARGET)  # NaN (does not fit) counts as changed
            out.append((s.name, kind, Episode(table, truth, f"{s.name}/{d}"), changed))
        print(f"{s.name}: {len(table)} candidates, {draws} draws", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draws", type=int, default=6, help="draws per held-out scenario (lie kinds in turn)")
    ap.add_argument("--budget", type=int, default=10)
    ap.add_argument("--only", default=None, help="comma-separated held-out scenario names")
    ap.add_argument("--quick", action="store_true", help="one scenario, 2 draws (the same code path)")
    args = ap.parse_args(argv)
    if args.quick:
        args.draws, args.only = 2, args.only or "consumer-tight-8"
    logging.basicConfig(level=logging.ERROR)
    import torch

    torch.set_num_threads(1)
    from autotune.policy.acquisition_training import (
        gain_and_teaching,
        greedy_gain,
        policy_chooser,
        run_episode,
        runs_to_target,
        simulator_order,
    )
    from autotune.policy.policy_file import load_policy_network
    from autotune.search.agents.acquire import STOP_GAIN, default_acquisition_path

    t0 = time.time()
    eps = episodes(args.draws, set(args.only.split(",")) if args.only else None)
    choosers = {
        "sim order": simulator_order,
        "greedy gain": greedy_gain,
        "gain + teach": gain_and_teaching,
        "agent": policy_chooser(load_policy_network(default_acquisition_path())),
    }
    curves = {
        name: [run_episode(ep, choose, args.budget, STOP_GAIN, planner_first=True) for _, _, ep, _ in eps]
        for name, choose in choosers.items()
    }
    print(f"\n{len(eps)} draws, budget {args.budget}, stop at {STOP_GAIN:.1%} expected gain, {time.time() - t0:.0f} s")
    groups = {"all": range(len(eps)), "changed": [i for i, e in enumerate(eps) if e[3]]}
    for kind in sorted({e[1] for e in eps}):
        groups[kind] = [i for i, e in enumerate(eps) if e[1] == kind]
    for group, idx in groups.items():
        idx = list(idx)
        if not idx:
            continue
        differ = sum(curves["agent"][i] != curves["greedy gain"][i] for i in idx)
        print(f"{group} ({len(idx)} draws; the agent's curve differs from the rule's on {differ})")
        for name in choosers:
            ks = [runs_to_target(curves[name][i]) for i in idx]
            shares = " / ".join(f"{np.mean([k is not None and k <= b for k in ks]):.0%}" for b in BUDGETS)
            found = np.mean([curves[name][i][-1] for i in idx])
            spent = np.mean([len(curves[name][i]) for i in idx])
            print(
                f"  {name:12s} within 2% after {'/'.join(map(str, BUDGETS))}: {shares:28s} found {found:.3f}  "
                f"spent {spent:.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
