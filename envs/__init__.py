"""Gymnasium environments over an evaluator. ``autotune/ParallelConfig-v0``: edit a parallel plan,
reward = throughput gain (see ``envs.parallel_config``). ``autotune/RealRuns-v0``: choose which candidate
plan to run for real next, reward = minus the regret of each run (see ``envs.acquisition``)."""

from gymnasium.envs.registration import register, registry

from envs.layout import ACTIONS, observation_features
from envs.parallel_config import ParallelConfigEnv

ENV_ID = "autotune/ParallelConfig-v0"
REAL_RUNS_ENV_ID = "autotune/RealRuns-v0"

if ENV_ID not in registry:
    register(id=ENV_ID, entry_point="envs.parallel_config:ParallelConfigEnv")
if REAL_RUNS_ENV_ID not in registry:
    register(id=REAL_RUNS_ENV_ID, entry_point="envs.acquisition:RealRunsEnv")

__all__ = ["ACTIONS", "ENV_ID", "REAL_RUNS_ENV_ID", "ParallelConfigEnv", "observation_features"]
