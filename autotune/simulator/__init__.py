"""The simulator evaluator: predicts iteration time, throughput and memory of a plan.

``Simulator(cluster, model, profile=None).evaluate(config) -> Measurement`` is the evaluator the search
calls; ``simulate(cluster, model, config)`` is the library call behind ``autotune simulate``.
Cost model: ``flops``, ``efficiency``, ``communication``, ``memory``; pipeline schedules: ``schedule``.
"""

from autotune.simulator.library import simulate
from autotune.simulator.simulator import Simulator

__all__ = ["Simulator", "simulate"]
