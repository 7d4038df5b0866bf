"""``autotune/RealRuns-v0``: choose which candidate plan to run for real next.

An episode is one search on one cluster: the planner's candidates (``autotune.planning.posterior.CandidateTable``,
fastest predicted first, at most ``MAX_CANDIDATES``) and, hidden from the agent, the iteration time each
really takes (``Episode.truth_s``; NaN: it does not run). Each step runs one candidate:

- observation: per candidate slot (``CANDIDATE_FEATURES``) whether it is there, run, failed; the posterior's
  mean log time against the best measured plan and its spread (``autotune.planning.posterior.Posterior``:
  every run so far refits the simulator's errors), its nominal prediction against the fastest, its error
  bar, its chance to fit in memory, its expected gain; then ``GLOBAL_FEATURES``;
- action: the slot to run (masked: empty slots, candidates already run);
- reward: ``best true time / best measured time so far - 1`` after the run (0 once the best plan has run, -1
  while nothing ran): the sum over the budget is minus the regret of every real run spent.

The episode ends after ``budget`` runs or when every candidate ran. ``observe`` builds the same observation
for a live search (``autotune.search.agents.acquire``).
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from autotune.planning.posterior import CandidateTable, Posterior

MAX_CANDIDATES = 64
#: the layout name policy files of this env carry (``autotune.policy.policy_file``)
LAYOUT = "acquisition"
CANDIDATE_FEATURES = (
    "present",
    "run",
    "failed",
    "mean_vs_best",
    "spread",
    "predicted_vs_fastest",
    "error_bar",
    "fit_probability",
    "expected_gain",
)
GLOBAL_FEATURES = ("runs_spent", "any_measured", "best_vs_posterior", "share_run")
OBSERVATIONS = MAX_CANDIDATES * len(CANDIDATE_FEATURES) + len(GLOBAL_FEATURES)
DEFAULT_BUDGET = 10


@dataclass(frozen=True, slots=True)
class Episode:
    """One training search: the candidates' table and what each really takes (NaN: does not run)."""

    table: CandidateTable
    truth_s: np.ndarray
    name: str = ""

    def __post_init__(self) -> None:
        if len(self.table) > MAX_CANDIDATES or len(self.truth_s) != len(self.table):
            raise ValueError(
                f"{len(self.table)} candidates and {len(self.truth_s)} true times (at most {MAX_CANDIDATES})"
            )
        object.__setattr__(self, "truth_s", np.asarray(self.truth_s, dtype=float))

    @property
    def best_s(self) -> float:
        ok = self.truth_s[~np.isnan(self.truth_s)]
        return float(ok.min()) if ok.size else float("nan")


def observe(post: Posterior, runs: int, budget: int) -> np.ndarray:
    """The observation of the module docstring for ``post`` after ``runs`` of ``budget`` runs."""
    t = post.table
    k = len(t)
    feats = np.zeros((MAX_CANDIDATES, len(CANDIDATE_FEATURES)), dtype=np.float32)
    best = post.best_measured_s
    unrun = ~post.run
    ref = np.log(best) if best is not None else float(post.mean_log_s.min())
    feats[:k, 0] = 1.0
    feats[:k, 1] = post.run
    feats[:k, 2] = post.failed
    feats[:k, 3] = np.clip((post.mean_log_s - ref) / 0.25, -1.0, 1.0)
    feats[:k, 4] = np.clip(post.std_log_s / 0.5, 0.0, 1.0)
    feats[:k, 5] = np.clip(np.log(t.predicted_s / t.predicted_s.min()) / 2.0, 0.0, 1.0)
    feats[:k, 6] = np.clip(t.expected_error / 1.5, 0.0, 1.0)
    feats[:k, 7] = post.fit_probability()
    feats[:k, 8] = np.clip(1.0 + np.log10(post.expected_gain() + 1e-4) / 4.0, 0.0, 1.0)  # 1e-4 .. 1 -> 0 .. 1
    best_vs = 0.0
    if best is not None and unrun.any():
        best_vs = float(np.clip((np.log(best) - post.mean_log_s[unrun].min()) / 0.25, -1.0, 1.0))
    glob = np.array(
        [min(1.0, runs / max(1, budget)), float(best is not None), best_vs, float(post.run.mean()) if k else 0.0],
        dtype=np.float32,
    )
    return np.concatenate([feats.ravel(), glob])


def mask(post: Posterior) -> np.ndarray:
    out = np.zeros(MAX_CANDIDATES, dtype=bool)
    out[: len(post.table)] = ~post.run
    return out


class RealRunsEnv(gym.Env):
    """The env of the module docstring over ``episodes`` (one drawn at random per reset)."""

    metadata = {"render_modes": []}

    def __init__(self, episodes: list[Episode], budget: int = DEFAULT_BUDGET, seed: int = 0) -> None:
        if not episodes:
            raise ValueError("no episodes")
        self.episodes, self.budget = episodes, budget
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(OBSERVATIONS,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(MAX_CANDIDATES)
        self._rng = np.random.default_rng(seed)
        self.episode: Episode | None = None

    def reset(self, *, seed: int | None = None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.episode = self.episodes[int(self._rng.integers(len(self.episodes)))]
        self.post = Posterior(self.episode.table)
        self.runs = 0
        self.best_true_s = np.inf  # the best true time among the plans run
        return observe(self.post, 0, self.budget), {}

    def action_masks(self) -> np.ndarray:
        return mask(self.post)

    def step(self, action: int):
        ep = self.episode
        a = int(action)
        if a >= len(ep.table) or self.post.run[a]:
            raise ValueError(f"candidate {a} is not open")
        truth = ep.truth_s[a]
        self.post.observe(a, None if np.isnan(truth) else float(truth))
        if not np.isnan(truth):
            self.best_true_s = min(self.best_true_s, float(truth))
        self.runs += 1
        reward = ep.best_s / self.best_true_s - 1.0 if np.isfinite(self.best_true_s) else -1.0
        done = self.runs >= self.budget or bool(self.post.run.all())
        return observe(self.post, self.runs, self.budget), float(reward), done, False, {"runs": self.runs}
