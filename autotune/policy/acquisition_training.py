"""Training the chooser of real runs (``envs.acquisition``) offline, with the simulator's errors randomised.

A training episode (``scenario_episodes``) is one scenario of the training mixture
(``autotune.policy.scenarios``: never a held-out GPU mix): the planner's candidates within the runner's
limits, their table (``autotune.planning.posterior.candidate_table``), and for each of ``draws`` realities
(``autotune.simulator.perturbation.draw_errors``: the error bars' distributions) the time every candidate
takes there (simulated on the perturbed cluster; NaN where it does not run, e.g. out of the perturbed
memory). Episodes are stored as plain arrays (``save_episodes``: ``.npz`` read without pickle).

``play`` runs one chooser on one episode and returns its curve (best true time found / true best, per run);
``CHOOSERS`` are the fixed rules it is compared with: the simulator's order, the greedy expected gain of
the posterior, and that gain plus what a run teaches about the other plans (``Posterior.teaching``). ``train`` fits MaskablePPO (sb3-contrib) on ``envs.acquisition.RealRunsEnv`` and keeps the
checkpoint that validates best (mean regret over the budget on validation episodes).
``scripts/train_acquisition.py`` is the command.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from autotune.planning.posterior import CandidateTable, Posterior, candidate_table, first_plans
from autotune.simulator.perturbation import draw_errors, perturb
from envs.acquisition import DEFAULT_BUDGET, MAX_CANDIDATES, Episode, RealRunsEnv, mask, observe

log = logging.getLogger(__name__)

_ARRAYS = ("predicted_s", "expected_error", "headroom", "sensitivity", "prior_sigma")
#: a plan within this share of the true best counts as found (issue 27's 98%)
TARGET = 0.98


def scenario_candidates(cluster, model, limit: int = MAX_CANDIDATES, refused=None) -> list:
    """The planner's plans for the scenario, fastest composed first, within the runner's limits (``refused``:
    config -> reason or None; default the runner's ``plan_limits``), at most ``limit``."""
    from autotune.planning.space import SearchSpace
    from autotune.simulator import Simulator

    space = SearchSpace(cluster, model)
    if refused is None:
        from runner.jobs import plan_limits

        limits = plan_limits(cluster, model)
        refused = limits if limits is not None else (lambda c: None)
    return first_plans(space, Simulator(cluster, model), lambda c: space.check(c) or refused(c), limit)


def scenario_episodes(scenario, draws: int, rng: np.random.Generator) -> list[Episode]:
    """``draws`` episodes of one scenario (module docstring); none when no candidate runs."""
    from autotune.simulator import Simulator

    cluster, model = scenario.cluster, scenario.model
    table = candidate_table(cluster, model, scenario_candidates(cluster, model), lambda c: Simulator(c, model))
    if not len(table):
        return []
    out = []
    for d in range(draws):
        real = Simulator(perturb(cluster, draw_errors(cluster, model.precision, rng)), model)
        truth = []
        for c in table.configs:
            m = real.evaluate(c)
            truth.append(m.iteration_time_s if m.ok else math.nan)
        if not np.isnan(truth).all():
            out.append(Episode(table, np.array(truth), f"{scenario.name}/{d}"))
    return out


def save_episodes(path: str | Path, episodes: list[Episode]) -> None:
    arrays = {}
    for i, ep in enumerate(episodes):
        for name in _ARRAYS:
            arrays[f"{i}/{name}"] = getattr(ep.table, name)
        arrays[f"{i}/truth_s"] = ep.truth_s
    np.savez_compressed(path, **arrays)


def load_episodes(path: str | Path) -> list[Episode]:
    with np.load(path, allow_pickle=False) as data:
        n = len({k.split("/")[0] for k in data.files})
        out = []
        for i in range(n):
            a = {name: data[f"{i}/{name}"] for name in _ARRAYS}
            table = CandidateTable((), **a, terms=("",) * len(a["prior_sigma"]))
            out.append(Episode(table, data[f"{i}/truth_s"], str(i)))
    return out


# -- choosers --------------------------------------------------------------------------------------------
Chooser = Callable[[Posterior, int, int], int]  # (posterior, runs so far, budget) -> candidate to run


def simulator_order(post: Posterior, runs: int, budget: int) -> int:
    """The fastest predicted candidate not run yet (the table is in that order)."""
    return post.first_not_run()


def _largest_open(post: Posterior, value: np.ndarray) -> int:
    """The candidate not run yet of largest ``value`` times its chance to fit (ties: the fastest predicted)."""
    value = value * post.fit_probability()
    value[post.run] = -1.0
    return int(np.argmax(value))


def greedy_gain(post: Posterior, runs: int, budget: int) -> int:
    """The candidate of largest expected gain times its chance to fit (ties: the fastest predicted)."""
    return _largest_open(post, post.expected_gain())


def gain_and_teaching(post: Posterior, runs: int, budget: int) -> int:
    """The candidate of largest expected gain plus what its run teaches about the others
    (``Posterior.teaching``), times its chance to fit (ties: the fastest predicted)."""
    return _largest_open(post, post.expected_gain() + post.teaching())


CHOOSERS: dict[str, Chooser] = {
    "simulator order": simulator_order,
    "greedy gain": greedy_gain,
    "gain and teaching": gain_and_teaching,
}


def policy_chooser(policy) -> Chooser:
    """The greedy (argmax) choice of a MaskablePPO policy network."""

    def choose(post: Posterior, runs: int, budget: int) -> int:
        action, _ = policy.predict(observe(post, runs, budget), action_masks=mask(post), deterministic=True)
        return int(action)

    return choose


def run_episode(
    episode: Episode, choose: Chooser, budget: int = DEFAULT_BUDGET, stop_gain: float | None = None, planner_first=False
) -> list[float]:
    """Best true time found / true best after each run made (the env's reward + 1 at each step,
    ``RealRunsEnv``): ``budget`` runs, fewer once every candidate ran or, with ``stop_gain``, once no candidate
    is expected to beat the best measured one by that much and the belief explains the runs
    (``Posterior.settled``, ``autotune.search.agents.acquire``'s rule);
    ``planner_first``: the first run is the planner's first plan, as in a search."""
    env = RealRunsEnv([episode], budget=budget)
    env.reset()
    curve: list[float] = []
    done = False
    while not done:
        post = env.post
        if curve and stop_gain is not None and post.settled(stop_gain):
            break
        i = post.first_not_run() if planner_first and not curve else choose(post, env.runs, budget)
        _, reward, done, _, _ = env.step(i)
        curve.append(1.0 + reward)
    return curve


def play(episode: Episode, choose: Chooser, budget: int = DEFAULT_BUDGET) -> list[float]:
    """``run_episode``'s curve over all ``budget`` runs (the last value kept once every candidate ran)."""
    curve = run_episode(episode, choose, budget)
    return curve + [curve[-1]] * (budget - len(curve))


def runs_to_target(curve: list[float], best: float = 1.0) -> int | None:
    """The first run (1-based) whose best-so-far reaches ``TARGET`` of ``best``; None when none does."""
    return next((i + 1 for i, v in enumerate(curve) if v >= TARGET * best), None)


def score(episodes: list[Episode], choose: Chooser, budget: int = DEFAULT_BUDGET) -> dict[str, float]:
    """Mean regret per run (1 - curve, averaged), median and 90th percentile of runs to ``TARGET``
    (budget + 1 when not reached), share within 1 / 3 runs."""
    curves = [play(ep, choose, budget) for ep in episodes]
    ks = sorted(k if (k := runs_to_target(c)) is not None else budget + 1 for c in curves)
    return {
        "regret": float(np.mean([1.0 - np.mean(c) for c in curves])),
        "median": float(ks[len(ks) // 2]),
        "p90": float(ks[min(len(ks) - 1, math.ceil(0.9 * len(ks)) - 1)]),
        "within_1": float(np.mean([k <= 1 for k in ks])),
        "within_3": float(np.mean([k <= 3 for k in ks])),
    }


def ranking_examples(
    episodes: list[Episode],
    budget: int = DEFAULT_BUDGET,
    explore: float = 0.3,
    seed: int = 0,
    teacher: str = "ranking",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(observations, masks, good) of the states met along ``greedy_gain``'s runs (a share ``explore`` of the
    steps picks an open candidate at random instead, to meet other states too): ``good`` marks the open
    candidates within ``TARGET`` of the best open one in truth (``teacher="ranking"``: what a perfect ranking
    would run next) or ``greedy_gain``'s choice (``teacher="greedy"``: imitation of the fixed rule)."""
    rng = np.random.default_rng(seed)
    obs, masks, good = [], [], []
    for ep in episodes:
        post = Posterior(ep.table)
        for runs in range(budget):
            open_ = mask(post)
            if not open_.any():
                break
            truth = np.full(MAX_CANDIDATES, np.inf)
            truth[: len(ep.table)] = np.where(np.isnan(ep.truth_s), np.inf, ep.truth_s)
            truth[~open_] = np.inf
            greedy = greedy_gain(post, runs, budget)
            if teacher == "greedy":
                obs.append(observe(post, runs, budget))
                masks.append(open_)
                good.append(np.arange(MAX_CANDIDATES) == greedy)
            elif np.isfinite(truth).any():
                obs.append(observe(post, runs, budget))
                masks.append(open_)
                good.append(truth <= truth.min() / TARGET)
            a = greedy if rng.random() >= explore else int(rng.choice(np.flatnonzero(open_)))
            t = ep.truth_s[a]
            post.observe(a, None if np.isnan(t) else float(t))
    return np.array(obs, dtype=np.float32), np.array(masks), np.array(good)


def warm_start(
    model,
    episodes: list[Episode],
    epochs: int = 30,
    seed: int = 0,
    learning_rate: float = 1e-3,
    teacher: str = "ranking",
) -> float:
    """Supervised ranking before PPO: fit the policy's move probabilities to put their mass on the candidates
    ``ranking_examples`` marks good (the log of that mass, maximised). Returns the final mean loss."""
    import torch

    obs, masks, good = (torch.as_tensor(a) for a in ranking_examples(episodes, seed=seed, teacher=teacher))
    policy = model.policy
    params = [*policy.mlp_extractor.score.parameters()]
    opt = torch.optim.Adam(params, lr=learning_rate)
    gen = torch.Generator().manual_seed(seed)
    loss_sum = 0.0
    for _ in range(epochs):
        order = torch.randperm(len(obs), generator=gen)
        loss_sum, batches = 0.0, 0
        for start in range(0, len(obs), 256):
            idx = order[start : start + 256]
            latent = policy.mlp_extractor.forward_actor(policy.extract_features(obs[idx], policy.pi_features_extractor))
            logits = policy.action_net(latent).masked_fill(~masks[idx], -1e9)
            loss = -(torch.logsumexp(logits.masked_fill(~good[idx], -1e9), 1) - torch.logsumexp(logits, 1)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum, batches = loss_sum + float(loss.detach()), batches + 1
        loss_sum /= max(1, batches)
    return loss_sum


def train(
    episodes: list[Episode],
    validation: list[Episode],
    steps: int,
    output: str | Path,
    seed: int = 0,
    validate_every: int = 20_000,
    budget: int = DEFAULT_BUDGET,
    n_steps: int = 1024,
    warm_epochs: int = 0,
    teacher: str = "greedy",
    learning_rate: float = 3e-4,
) -> dict:
    """MaskablePPO on ``episodes``; every ``validate_every`` steps the greedy policy is scored on
    ``validation`` and the best checkpoint written to ``output`` (``policy_file``: no pickle). With
    ``warm_epochs``, supervised ``warm_start`` (``teacher``) comes first and is the first checkpoint. A rollout is
    ``n_steps`` steps (each ``learn`` call collects whole rollouts). Returns the record (the validation curve
    from the untrained policy on, steps, CPU seconds)."""
    import torch
    from sb3_contrib import MaskablePPO

    from autotune.policy import policy_file

    torch.set_num_threads(1)
    env = RealRunsEnv(episodes, budget=budget, seed=seed)
    from autotune.policy.candidate_policy import CandidatePolicy

    model = policy_file.without_log_folder(
        MaskablePPO(
            CandidatePolicy,
            env,
            n_steps=n_steps,
            batch_size=min(128, n_steps),
            n_epochs=6,
            learning_rate=learning_rate,
            gamma=0.9,
            ent_coef=0.01,
            seed=seed,
            device="cpu",
            verbose=0,
            policy_kwargs={"net_arch": [64, 64], "activation_fn": torch.nn.Tanh},
        )
    )
    cpu0, t0 = time.process_time(), time.time()
    record: dict = {"validation": [], "episodes": len(episodes), "validation_episodes": len(validation)}
    best = math.inf
    done = 0
    if warm_epochs:
        record["warm_start"] = {
            "teacher": teacher,
            "epochs": warm_epochs,
            "loss": warm_start(model, episodes, epochs=warm_epochs, seed=seed, teacher=teacher),
        }
    first = score(validation, policy_chooser(model.policy), budget)
    record["validation"].append({"steps": 0, **first})
    if warm_epochs:  # the warm-started policy is a checkpoint too
        best = first["regret"]
        policy_file.save(model, output, trained_steps=0, validation_regret=round(best, 5))
    while done < steps:
        chunk = min(validate_every, steps - done)
        model.learn(total_timesteps=chunk, reset_num_timesteps=False)
        done += chunk
        result = score(validation, policy_chooser(model.policy), budget)
        record["validation"].append({"steps": done, **result})
        log.info("acquisition: %d steps, validation %s", done, result)
        if result["regret"] < best:
            best = result["regret"]
            policy_file.save(model, output, trained_steps=done, validation_regret=round(best, 5))
    record.update(steps=done, cpu_s=round(time.process_time() - cpu0, 1), wall_s=round(time.time() - t0, 1))
    record["best_regret"] = best
    return record
