"""Gymnasium environments over an evaluator. ``autotune/ParallelConfig-v0``: edit a parallel plan,
reward = throughput gain (see ``envs.parallel_config``)."""

from gymnasium.envs.registration import register, registry

from envs.layout import ACTIONS, observation_features
from envs.parallel_config import ParallelConfigEnv

ENV_ID = "autotune/ParallelConfig-v0"

if ENV_ID not in registry:
    register(id=ENV_ID, entry_point="envs.parallel_config:ParallelConfigEnv")

__all__ = ["ACTIONS", "ENV_ID", "ParallelConfigEnv", "observation_features"]
