"""What every search method shares, below the env and the agents: the plan space (``space``, its
vocabulary and its feature families ``mixed_space``, ``roundpipe_space``, ``moe_space``), the one budget
rule (``budget``), the memory-first screen (``memory_first``) and the structured planner (``planner``).

Nothing here imports the env, the agents, the library call or the RL policy (``autotune.search``,
``autotune.policy``, ``envs`` sit above it)."""
