"""Train the chooser of real runs (``--method rl --backend real``): MaskablePPO on ``autotune/RealRuns-v0``.

Draws ``--scenarios`` training scenarios (``autotune.policy.scenarios``: training seeds and GPU mixes only)
and ``--validation-scenarios`` validation ones (their own seed stream; never the held-out set), builds
``--draws`` perturbed realities of each (``autotune.policy.acquisition_training``: the simulator's errors
drawn from its error bars), warm-starts the policy by imitating the greedy expected-gain rule (``--warm-epochs``,
``--teacher``), trains MaskablePPO for ``--steps`` env steps and keeps the checkpoint that validates best.
Prints the validation curve beside the fixed rules (simulator order, greedy expected gain, gain and
teaching), the training time and CPU seconds, and writes them beside the policy (``.json``). The episodes are
cached in ``--episodes`` (plain arrays, rebuilt when missing).

    .venv/bin/python scripts/train_acquisition.py --output autotune/data/acquisition.safetensors
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from autotune.policy.acquisition_training import (
    CHOOSERS,
    load_episodes,
    save_episodes,
    scenario_episodes,
    score,
    train,
)
from autotune.policy.scenarios import draw_scenario, training_rng, validation_rng


def build(path: Path, n: int, draws: int, rng_of, name: str) -> list:
    if path.exists():
        return load_episodes(path)
    episodes, t0 = [], time.time()
    for i in range(n):
        s = draw_scenario(rng_of(i), name=f"{name}{i}")
        episodes += scenario_episodes(s, draws, np.random.default_rng([i, draws, len(name)]))
        logging.info(
            "%s %d/%d: %s (%d episodes, %.0f s)", name, i + 1, n, s.describe(), len(episodes), time.time() - t0
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    save_episodes(path, episodes)
    return episodes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", type=int, default=60)
    ap.add_argument("--validation-scenarios", type=int, default=16)
    ap.add_argument("--draws", type=int, default=12, help="perturbed realities per scenario")
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--validate-every", type=int, default=20_000)
    ap.add_argument("--n-steps", type=int, default=1024, help="env steps per PPO rollout")
    ap.add_argument("--warm-epochs", type=int, default=40, help="supervised warm start first (0: none)")
    ap.add_argument("--teacher", default="greedy", choices=("greedy", "ranking"), help="what the warm start imitates")
    ap.add_argument("--lr", type=float, default=1e-4, help="PPO's learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--episodes", default="experiments/out/acquisition_episodes", help="cache folder")
    ap.add_argument("--output", default="autotune/data/acquisition.safetensors")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cache = Path(args.episodes)
    tag = f"{args.scenarios}x{args.draws}"
    train_eps = build(cache / f"train-{tag}.npz", args.scenarios, args.draws, training_rng, "train")
    val_eps = build(
        cache / f"validation-{args.validation_scenarios}x{args.draws}.npz",
        args.validation_scenarios,
        args.draws,
        validation_rng,
        "val",
    )
    baselines = {name: score(val_eps, fn) for name, fn in CHOOSERS.items()}
    for name, result in baselines.items():
        print(f"{name:16s} {result}", flush=True)
    record = train(
        train_eps,
        val_eps,
        args.steps,
        args.output,
        seed=args.seed,
        validate_every=args.validate_every,
        warm_epochs=args.warm_epochs,
        teacher=args.teacher,
        learning_rate=args.lr,
        n_steps=args.n_steps,
    )
    for row in record["validation"]:
        print(f"policy @{row['steps']:>7d} {row}", flush=True)
    load = os.getloadavg()
    record.update(
        baselines=baselines,
        load_average=load,
        args=vars(args),
        command="python " + " ".join(sys.argv),
        timesteps=record["steps"],  # the keys experiments/quality/heldout_eval.py prints
        train_time_s=record["wall_s"],
        cpu=f"{os.cpu_count()} CPU cores, torch 1 thread, load average {load[0]:.1f} at the end",
    )
    Path(args.output).with_suffix(".json").write_text(json.dumps(record, indent=1))
    print(
        f"{record['steps']} steps, {record['cpu_s']} CPU s, {record['wall_s']} s; best validation regret "
        f"{record['best_regret']:.4f} -> {args.output}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
