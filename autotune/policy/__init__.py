"""The learned chooser of ``--method rl``: what it is trained on and how it is stored.

- ``scenarios``: the training (and held-out) distribution of clusters and models;
- ``acquisition_training``: episodes with the simulator's errors randomised, the chooser's training and its
  scores (``scripts/train_acquisition.py`` runs it);
- ``candidate_policy``: the chooser's network (one score per candidate, the same weights for each);
- ``policy_file``: policy files without pickle (``autotune/data/acquisition.safetensors``).

Its use in a search is ``autotune.search.agents.acquire``. Everything here sits on top of what every method
shares (``autotune.planning``, ``autotune.evaluator``) and of the env (``envs``); the shared parts import
nothing from here.
"""
