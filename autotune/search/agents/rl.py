"""``rl --policy scratch``: sb3-contrib MaskablePPO learning online on ``autotune/ParallelConfig-v0`` within the
budget, from nothing: every env step edits the plan and evaluates it through the shared ``BudgetedEvaluator``
(repeats are free), and learning stops the moment the budget is spent.

``rl`` itself (any other ``--policy``) is the learned chooser of which candidate plan to evaluate next
(``autotune.search.agents.acquire``).
"""

from __future__ import annotations

import logging

from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.space import SearchSpace

log = logging.getLogger(__name__)

#: env steps allowed per unit of budget before the agent gives up (steps on cached plans are free)
STEPS_PER_EVALUATION = 40
#: ``--policy`` meaning "no trained policy: learn online from scratch within the budget"
SCRATCH = "scratch"


def make_model(env, seed: int, n_steps: int = 64):
    """A small MaskablePPO, sized for a budget of tens to hundreds of evaluations."""
    import torch
    from sb3_contrib import MaskablePPO

    from autotune.policy.policy_file import without_log_folder

    torch.set_num_threads(1)
    return without_log_folder(
        MaskablePPO(
            "MlpPolicy",
            env,
            n_steps=n_steps,
            batch_size=32,
            n_epochs=4,
            learning_rate=3e-4,
            gamma=0.9,
            ent_coef=0.01,
            seed=seed,
            device="cpu",
            verbose=0,
            policy_kwargs={"net_arch": [128, 128]},
        )
    )


def run_rl(
    space: SearchSpace,
    evaluator: BudgetedEvaluator,
    budget: int | None = None,
    seed: int = 0,
    max_episode_steps: int = 32,
    n_steps: int = 64,
    start_from_best: bool = True,
) -> None:
    """Spend ``evaluator``'s budget with MaskablePPO. ``budget`` defaults to the evaluator's; every
    episode after the first starts from the best plan found so far (``start_from_best``)."""
    import torch
    from stable_baselines3.common.callbacks import BaseCallback

    from envs.layout import actions_for
    from envs.parallel_config import ParallelConfigEnv

    torch.set_num_threads(1)
    if budget is not None and budget != evaluator.budget:
        evaluator.budget = budget
    # learn online from scratch
    env = ParallelConfigEnv(
        space,
        evaluator,
        max_steps=max_episode_steps,
        start_from_best=start_from_best,
        actions=actions_for(space, mixed=True),
    )  # with the mixed-stage moves
    max_steps = max(STEPS_PER_EVALUATION * evaluator.budget, 2 * n_steps)

    class StopOnBudget(BaseCallback):
        def _on_step(self) -> bool:
            return not evaluator.exhausted

    model = make_model(env, seed, n_steps)
    if evaluator.exhausted:
        return
    model.learn(total_timesteps=max_steps, callback=StopOnBudget())
    if not evaluator.exhausted:
        evaluator.ended = f"the agent's {max_steps:,} steps found no more new plans"
        log.info("rl: %s; %d of %d evaluations", evaluator.ended, evaluator.used, evaluator.budget)
