"""The pretrained RL policy: training env across scenarios, and its use on a new cluster.

A search with few evaluations is a walk over plans that should improve at every step. The policy is
trained to choose that walk's next step, on the moves of ``autotune/ParallelConfig-v0``
(``envs.layout.ACTIONS``, the same list on every cluster) and its fixed-size, normalised,
cluster-size independent observation. ``SearchEnv`` gives the walk best-first semantics, the same
in training and in use:

- the state is the best plan found so far (before any plan runs: the failed plan closest to
  fitting in memory);
- each step evaluates one *untried* neighbour (moves to plans already evaluated are masked: every
  step spends exactly one evaluation); the walk moves there only if it is better (runs and is
  faster; or, while nothing runs yet, overflows memory less), else stays;
- reward = log(new best / old best) on an improvement, 0 otherwise, ``FIRST_RUN_REWARD`` for the
  first plan that runs, a small shaped reward for reducing the memory overflow before that. The
  sum over an episode is log(best found / start), so with discount < 1 the policy learns to reach
  the best plan in few evaluations.

``ScenarioEnv`` draws a new random scenario (``autotune.policy.scenarios``) at every reset
(domain randomisation) and runs a ``SearchEnv`` of ``episode_evaluations`` steps on it with the
simulator. ``scripts/train_policy.py`` trains MaskablePPO on it and writes
``autotune/data/policy.safetensors`` (``autotune.policy.policy_file``: weights as raw tensors and
the network as JSON, never pickle).

On a new scenario ``run_pretrained`` (``--method rl``, the shipped policy by default) starts from the
speed-proportional plans of ``SearchSpace.heuristic_params`` (evaluated in order until one runs),
then lets the policy pick each next plan greedily (argmax over the unmasked moves). When the
neighbourhood of the best plan is used up or the walk stalls, it restarts from a random valid plan.
When the search already holds plans that are points of the space (``autotune.tune`` evaluates the
structured planner's best plans first by default, each anchored by ``SearchSpace.encode``) and the best of
them beats its own starts, the walk continues from it, and its moves edit that plan: a state move (ZeRO,
offload, recomputation, ...) changes only that choice, a fine edit re-anchors, a structural move re-decodes.
``fine_tune=True`` instead keeps learning (PPO updates, sampled actions) on the evaluations of this
search until the budget is spent. Every evaluation goes through the ``BudgetedEvaluator`` the caller
passes in (simulator or real profiled runs), so the budget rule is the one every method shares.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from autotune.evaluator import CachedEvaluator, Evaluator
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.encoding import ANCHOR, sync_params
from autotune.planning.space import Params, SearchSpace
from autotune.policy.scenarios import Scenario, draw_scenario, training_rng
from autotune.policy.starts import start_candidates, with_frugal_start
from autotune.specs import Measurement, ParallelConfig
from envs.layout import ACTIONS, FULL_ACTIONS, ZERO_ACTIONS, actions_for, observation_features
from envs.parallel_config import ParallelConfigEnv

log = logging.getLogger(__name__)

_STEPS_LEFT = observation_features().index("steps_left")

#: reward for the first plan of an episode that runs (when the start did not)
FIRST_RUN_REWARD = 0.5
#: weight of the shaped reward log(old overflow / new overflow) while no plan runs yet
OVERFLOW_REWARD_WEIGHT = 0.2
#: a greedy walk restarts after this many evaluations in a row without improvement
STALL_RESTART = 12
#: rollout length (evaluations) between PPO updates when fine-tuning online
FINE_TUNE_STEPS = 16


def default_policy_path() -> Path:
    """The policy shipped with the package (``autotune/data/policy.safetensors``)."""
    return Path(__file__).resolve().parent.parent / "data" / "policy.safetensors"


class SearchEnv(ParallelConfigEnv):
    """``ParallelConfigEnv`` with best-first semantics: stay on the best plan, try untried neighbours.

    Observations and moves are the parent's; the differences are the mask (neighbours already tried in
    this episode are masked, and with ``exclude_evaluated`` every plan the evaluator has seen, so in a
    search a step always costs one evaluation), the transition (move only to a better plan) and the
    reward (see the module docstring). ``place`` puts the walk on any plan.
    """

    def __init__(
        self,
        space: SearchSpace,
        evaluator: Evaluator,
        *,
        max_steps: int = 16,
        start_params: Params | None = None,
        exclude_evaluated: bool = False,
        actions: tuple[tuple, ...] | None = None,
    ) -> None:
        super().__init__(space, evaluator, max_steps=max_steps, actions=actions)
        self._starts = start_candidates(space) or self._starts  # the parent's reset tries these in order
        self._starts = with_frugal_start(space, self._starts, evaluator)
        self.start_params = start_params
        self.improvements = 0
        self.since_improvement = 0
        self._overflow = math.inf
        self._tried: set[ParallelConfig] = set()
        #: also mask plans the evaluator has seen before this episode (in use: a search never repeats a
        #: plan); off, the episode depends only on its reset (Gymnasium's determinism check)
        self.exclude_evaluated = exclude_evaluated

    # -- placing the walk ----------------------------------------------------------------------------
    def place(self, params: Params, config: ParallelConfig, measurement: Measurement) -> None:
        """Make ``config`` (already evaluated as ``measurement``) the walk's current plan."""
        self.params = self._following(params, config)
        self.config, self.measurement = config, measurement
        self.score = measurement.score()
        self.best_score = max(self.best_score, self.score)
        self._overflow = 0.0 if measurement.ok else self._relative_overflow(config, measurement)
        self._tried.add(config)
        self._candidates = None

    def _following(self, params: Params, config: ParallelConfig) -> Params:
        """The walk's params for ``config``: ``params``' dimensions (and anchor) in step with fine edits; a fine
        edit of an anchored plan (``SearchSpace.encode``, e.g. dp's start) anchors at the edited plan, so that
        the next move of a dimension keeps the edit."""
        names = {d.name for d in self.space.dimensions} | {ANCHOR}
        out = {k: v for k, v in params.items() if k in names}
        if ANCHOR in out and self.space.decode(out).config != config:
            return self.space.encode(config)
        sync_params(out, config)
        return out

    def _relative_overflow(self, config: ParallelConfig, m: Measurement) -> float:
        if not m.peak_memory_GiB:
            return math.inf
        return max(v / self.space.cluster.device(d).memory_GiB for d, v in m.peak_memory_GiB.items())

    # -- gymnasium API ---------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        options = dict(options or {})
        if self.start_params is not None and "params" not in options:
            options["params"] = self.start_params
        obs, info = super().reset(seed=seed, options=options)
        self.steps = 0
        self.improvements = 0
        self.since_improvement = 0
        self._tried = {self.config} if self.config is not None else set()
        m = self.measurement
        self._overflow = (
            0.0
            if m is not None and m.ok
            else (self._relative_overflow(self.config, m) if m is not None and self.config is not None else math.inf)
        )
        return self._observation(), info

    def action_masks(self) -> np.ndarray:
        cands = self._get_candidates()
        mask = np.array([c is not None and not self._is_tried(c[0]) for c in cands], dtype=bool)
        if not mask.any():
            mask[0] = True  # noop: the neighbourhood is used up (the step then ends the episode)
        return mask

    def _is_tried(self, config: ParallelConfig) -> bool:
        return config == self.config or config in self._tried or (self.exclude_evaluated and config in self.evaluator)

    def _observation(self) -> np.ndarray:
        obs = super()._observation()
        obs[_STEPS_LEFT] = 0.0  # the walk has no fixed horizon in use: the same in training
        return obs

    def untried_moves(self) -> int:
        mask = self.action_masks()
        return int(mask[1:].sum())

    def step(self, action):
        a = int(action)
        cands = self._get_candidates()
        cand = cands[a] if 0 <= a < len(cands) else None
        if a == 0 or cand is None or self._is_tried(cand[0]):
            # noop or a masked move: nothing is evaluated; the episode ends when nothing is left
            done = self.untried_moves() == 0
            return self._observation(), 0.0, False, done or self.steps >= self.max_steps, self._info(noop=True)
        config, params = cand
        if self._out_of_budget(config):
            return self._observation(), 0.0, False, True, self._info(budget_exhausted=True)
        self.steps += 1
        self._tried.add(config)
        m = self._evaluate(config, params)
        reward = 0.0
        moved = False
        if m.ok:
            self._last_failed = False
            new = m.score()
            if self.score <= 0:
                reward, moved = FIRST_RUN_REWARD, True
            elif new > self.score:
                reward, moved = float(min(math.log(new / self.score), 1.0)), True
        else:
            self._last_failed = True
            if self.score <= 0:
                over = self._relative_overflow(config, m)
                if over < self._overflow:
                    gain = math.log(self._overflow / over) if math.isfinite(self._overflow) else 1.0
                    reward, moved = OVERFLOW_REWARD_WEIGHT * float(min(gain, 1.0)), True
        if moved:
            self.params, self.config, self.measurement = self._following(params, config), config, m
            self.score = m.score()
            self.best_score = max(self.best_score, self.score)
            self._overflow = 0.0 if m.ok else self._relative_overflow(config, m)
            self._candidates = None
            self.improvements += 1
            self.since_improvement = 0
        else:
            self.since_improvement += 1
        truncated = self.steps >= self.max_steps
        info = self._info(moved=moved, status="oom" if m.oom else m.status)
        return self._observation(), reward, False, truncated, info


class LayoutView(gym.Wrapper):
    """A ``SearchEnv`` seen through an older layout's observation: its first ``obs_dim`` features (for
    fine-tuning a policy trained before features were appended)."""

    def __init__(self, env: SearchEnv, obs_dim: int) -> None:
        super().__init__(env)
        self.obs_dim = obs_dim
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(obs_dim,), dtype=np.float32)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs[: self.obs_dim], info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs[: self.obs_dim], reward, terminated, truncated, info

    def action_masks(self) -> np.ndarray:
        return self.env.action_masks()


class ScenarioEnv(gym.Env):
    """Domain randomisation: every reset draws a scenario and runs a ``SearchEnv`` episode on it.

    The simulator is the evaluator (cached per scenario). With probability ``random_start_prob`` the
    episode starts from a random valid plan instead of the speed-proportional start, so the policy
    also learns to climb from poor plans (what the greedy walk meets after a restart).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        seed: int = 0,
        episode_evaluations: int = 16,
        random_start_prob: float = 0.3,
        scenarios: list[Scenario] | None = None,
    ) -> None:
        super().__init__()
        self._rng = training_rng(seed)
        self.episode_evaluations = episode_evaluations
        self.random_start_prob = random_start_prob
        self.scenarios = scenarios
        probe = _probe_env()
        self.observation_space = probe.observation_space
        self.action_space = probe.action_space
        self.env: SearchEnv | None = None
        self.scenario: Scenario | None = None

    def _draw(self) -> Scenario:
        if self.scenarios:
            return self.scenarios[int(self._rng.integers(len(self.scenarios)))]
        return draw_scenario(self._rng, check_feasible=False)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        from autotune.simulator import Simulator

        if seed is not None:
            self._rng = training_rng(seed)

        self.scenario = self._draw()
        space = SearchSpace(self.scenario.cluster, self.scenario.model)
        evaluator = CachedEvaluator(Simulator(self.scenario.cluster, self.scenario.model))
        start = None
        if self._rng.random() < self.random_start_prob:
            try:
                start, _ = space.sample_valid(self._rng, tries=200)
            except Exception:  # no valid random plan found: take the heuristic start
                start = None
        self.env = SearchEnv(
            space,
            evaluator,
            max_steps=self.episode_evaluations,
            start_params=start,
            exclude_evaluated=True,
            actions=FULL_ACTIONS,
        )
        return self.env.reset(seed=int(self._rng.integers(2**31)))

    def step(self, action):
        assert self.env is not None, "call reset() first"
        return self.env.step(action)

    def action_masks(self) -> np.ndarray:
        assert self.env is not None, "call reset() first"
        return self.env.action_masks()


_PROBE: ParallelConfigEnv | None = None


def _probe_env() -> ParallelConfigEnv:
    """A tiny env whose spaces every scenario shares (they depend only on the env's constants)."""
    global _PROBE
    if _PROBE is None:
        from autotune.loading import load_cluster, load_model
        from autotune.simulator import Simulator

        cluster, model = load_cluster("mixed-a100-v100"), load_model("tiny")
        _PROBE = ParallelConfigEnv(SearchSpace(cluster, model), Simulator(cluster, model), actions=FULL_ACTIONS)
    return _PROBE


# --------------------------------------------------------------------------------------------------
# Using the policy


def load_policy(path: str | Path | None = None):
    """The policy network at ``path`` (default: the shipped one), on the CPU, one thread. Files are
    read by ``autotune.policy.policy_file`` (no pickle); anything else is a one-line ``SpecError``."""
    import torch

    from autotune.errors import SpecError
    from autotune.policy import policy_file

    torch.set_num_threads(1)
    path = Path(path) if path is not None else default_policy_path()
    if not path.exists():
        raise SpecError(str(path), "policy", "file not found (train one with scripts/train_policy.py)")
    return policy_file.load_policy_network(path)


def policy_layout(policy) -> tuple[int, int]:
    """(observations, moves) the policy was trained on: today's layout or an older prefix of it
    (``envs.layout.LAYOUTS``)."""
    return int(policy.observation_space.shape[0]), int(policy.action_space.n)


def greedy_action(policy, obs: np.ndarray, mask: np.ndarray, deterministic: bool = True) -> int:
    """The policy's move among the moves it knows (the first ``n`` of its layout), from the features it
    knows (a policy of an older layout reads today's observation's prefix); 0 (noop) when none is open."""
    n_obs, n_act = policy_layout(policy)
    known = mask[:n_act]
    if not known.any():
        return 0
    action, _ = policy.predict(obs[:n_obs], action_masks=known, deterministic=deterministic)
    return int(action)


def newer_move(env: SearchEnv, mask: np.ndarray, n_act: int) -> int | None:
    """An open zero / offload move the policy does not know (``ZERO_ACTIONS``, appended after its
    layout) to try now: while no plan runs, those that shrink device memory (``zero+``, ``offload+``);
    once the walk has stalled on a plan that runs, ``offload-`` and ``zero-`` (faster if it still fits)
    first, then the others."""
    open_moves = [a for a in range(n_act, len(mask)) if mask[a] and env.actions[a] in ZERO_ACTIONS]
    if not open_moves:
        return None
    if env.score <= 0:
        grow = [a for a in open_moves if env.actions[a][2] > 0]
        return grow[0] if grow else None
    return sorted(open_moves, key=lambda a: (env.actions[a][2] > 0, env.actions[a][1] != "offload"))[0]


def run_pretrained(
    space: SearchSpace,
    evaluator: BudgetedEvaluator,
    seed: int = 0,
    *,
    policy_path: str | Path | None = None,
    policy: Any = None,
    fine_tune: bool = False,
    stall_restart: int = STALL_RESTART,
    order: str = "policy",
    sample: bool = False,
    starts: int = 2,
) -> None:
    """Spend ``evaluator``'s budget with the pretrained policy (see the module docstring).

    ``starts`` start plans that run are evaluated before the walk, which begins at the best of them.
    ``sample=True`` draws each move from the policy's distribution instead of taking its argmax.
    Restarts (after ``stall_restart`` evaluations without improvement) go to the next untried start
    plan, then to random valid plans.
    ``order="random"`` replaces the policy's choice with a uniformly random untried move (the same
    walk without the policy: the ablation in experiments/quality/heldout_eval.py).
    """
    if fine_tune:
        _fine_tune(space, evaluator, seed, policy_path)
        return
    if policy is None and order == "policy":
        policy = load_policy(policy_path)
    rng = np.random.default_rng(seed)
    if sample:
        import torch

        torch.manual_seed(seed)
    # a policy of layout "full" chooses among the fixed move list it was trained on (every dimension);
    # older layouts read a prefix of today's list, and the walk adds the moves they lack (below)
    full = order == "policy" and policy_layout(policy)[1] == len(FULL_ACTIONS)
    env = SearchEnv(
        space, evaluator, max_steps=10**9, exclude_evaluated=True, actions=FULL_ACTIONS if full else actions_for(space)
    )
    names = {d.name for d in space.dimensions}
    obs, _ = env.reset(seed=seed)
    if starts > 1 and env.score > 0:
        best = (env.score, env.params)
        ran = 1
        for params in env._starts:
            if ran >= starts or evaluator.exhausted:
                break
            decoded = space.decode(params)
            if not decoded.ok or decoded.config in evaluator:
                continue
            m = evaluator.evaluate(decoded.config, params)
            if m.ok:
                ran += 1
                if m.score() > best[0]:
                    best = (m.score(), params)
        obs, _ = env.reset(seed=seed, options={"params": best[1]})
    prior = evaluator.best  # e.g. the structured planner's plan (``tune(start="dp")``)
    if prior is not None and prior.score > env.score and prior.config != env.config:
        # a point of the space (dp's plans are anchored points: ``SearchSpace.encode``; RoundPipe's start)
        # brings its own choices, so the walk's moves edit that plan; others keep the walk's
        own = set(prior.params) >= names
        env.place(prior.params if own else env.params, prior.config, prior.measurement)
        obs = env._observation()
    moves = 0
    n_act = policy_layout(policy)[1] if order == "policy" else len(env.actions)
    moe = np.array([i >= n_act and act not in ZERO_ACTIONS for i, act in enumerate(env.actions)])
    while not evaluator.exhausted:
        mask = env.action_masks()
        used_up = not mask[1:].any()
        # zero / offload moves the policy does not know: tried first while nothing runs, and before a restart
        stalled = env.since_improvement >= stall_restart
        newer = newer_move(env, mask, n_act) if order == "policy" and (env.score <= 0 or stalled) else None
        if newer is None and (used_up or stalled):
            obs = _restart(env, space, evaluator, rng)
            if obs is None:
                log.info("rl: no untried plan reachable; stopping at %d evaluations", evaluator.used)
                return
            continue
        moves += 1
        known = mask.copy()
        known[n_act:] = False
        extra = np.flatnonzero(mask & moe)
        if newer is not None:
            a = newer
        elif order == "policy" and extra.size and (moves % 2 == 0 or not known[1:].any()):
            # MoE moves (the policy was trained on dense plans and has no outputs for them): every second
            # step, and whenever the policy's own moves are used up, the walk tries the first untried one
            a = int(extra[0])
        elif order == "policy":
            a = greedy_action(policy, obs, known, deterministic=not sample)
            if not known[a]:  # nothing the policy knows is open (the zero / offload moves are): take one
                a = newer_move(env, mask, n_act) or int(np.flatnonzero(mask)[0])
        else:
            a = int(rng.choice(np.flatnonzero(mask)))
        obs, _, _, truncated, info = env.step(a)
        if info.get("budget_exhausted"):
            return


def _restart(env: SearchEnv, space: SearchSpace, evaluator: BudgetedEvaluator, rng: np.random.Generator):
    """Continue the walk from a plan not yet evaluated (evaluating it): the next start plan, else a
    random valid plan; None when there is none."""
    candidates = list(env._starts) + [space.sample(rng) for _ in range(500)]
    for params in candidates:
        decoded = space.decode(params)
        if not decoded.ok or decoded.config in evaluator:
            continue
        if evaluator.exhausted:
            return None
        m = evaluator.evaluate(decoded.config, params)
        env.since_improvement = 0
        if m.ok:  # the walk follows the new plan even when it is worse than the best
            env.place(params, decoded.config, m)
            return env._observation()
    return None


def _fine_tune(space: SearchSpace, evaluator: BudgetedEvaluator, seed: int, policy_path: str | Path | None) -> None:
    """Online fine-tuning: PPO updates (every ``FINE_TUNE_STEPS`` evaluations) on this search's own
    evaluations, actions sampled from the policy, until the budget is spent."""
    import torch
    from stable_baselines3.common.callbacks import BaseCallback

    from autotune.policy import policy_file

    torch.set_num_threads(1)
    path = Path(policy_path) if policy_path is not None else default_policy_path()
    # the policy's own moves only: MoE plans are reached through the start plans (SearchSpace.heuristic_params),
    # and so are zero / offload plans for a policy of the first layout, which sees the features it knows
    _, meta = policy_file.read(path)
    actions = {len(ACTIONS): ACTIONS, len(ACTIONS) + len(ZERO_ACTIONS): ACTIONS + ZERO_ACTIONS}.get(
        meta["n_actions"], FULL_ACTIONS
    )
    env = SearchEnv(space, evaluator, max_steps=FINE_TUNE_STEPS, exclude_evaluated=True, actions=actions)
    if meta["obs_dim"] != env.observation_space.shape[0]:
        env = LayoutView(env, meta["obs_dim"])
    model = policy_file.load_model(path, env, seed, n_steps=FINE_TUNE_STEPS, batch_size=FINE_TUNE_STEPS)

    class StopOnBudget(BaseCallback):
        def _on_step(self) -> bool:
            return not evaluator.exhausted

    # a step that evaluates nothing (masked-out noop at a used-up neighbourhood) ends its episode,
    # so the step limit only guards against a policy that never spends the budget
    model.learn(total_timesteps=4 * evaluator.budget + 2 * FINE_TUNE_STEPS, callback=StopOnBudget())
