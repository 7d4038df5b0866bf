"""The pretrained RL policy of ``--method rl``: what it is trained on and how it is used.

- ``scenarios``: the training (and held-out) distribution of clusters and models;
- ``pretrained``: the best-first search env the policy is trained and used in, the policy file
  (``autotune/data/policy.*``, no pickle) and ``run_pretrained``, the walk ``--method rl`` runs.

Training itself is ``scripts/train_policy.py``. Everything here sits on top of what every method
shares (``autotune.planning.space``, ``autotune.planning.budget``, ``autotune.evaluator``) and of the env
(``envs``); the shared parts import nothing from here.
"""
