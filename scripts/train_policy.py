"""Pretrain the `--method rl` policy: MaskablePPO across random scenarios on the simulator backend.

Each env reset draws a new scenario (autotune.policy.scenarios, training seeds and GPU mixes only:
the held-out set is never drawn) and runs one best-first search episode of
``--episode-evaluations`` evaluations on it (autotune.policy.pretrained.ScenarioEnv). Training is
logged to MLflow (one run: hyper-parameters, rollout metrics, validation metric, the policy as an
artifact); every ``--validate-every`` steps the greedy policy is scored on validation scenarios (a
separate seed stream, never the held-out set) and the best-scoring checkpoint is kept.

    .venv/bin/python scripts/train_policy.py --minutes 20 --output autotune/data/policy.safetensors

``--init FILE`` continues from a policy file; one of an older env layout is widened to today's
(``policy_file.widen``: the appended features and moves start with zero weights). Every validation
also writes the latest weights to ``<output>.last.safetensors``, so a run stopped at any point leaves
a usable policy (the best-validating one at ``--output``). Prints the training time, CPU seconds, the
machine's load, the validation curve and the saved file's size (all also in ``<output>.json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.space import SearchSpace
from autotune.policy import policy_file
from autotune.policy.pretrained import ScenarioEnv, run_pretrained
from autotune.policy.scenarios import Scenario, draw_scenario, validation_rng
from autotune.simulator import Simulator

log = logging.getLogger("train_policy")


#: the kinds of the validation scenarios, in turn (``large`` left out: its reference costs minutes)
VALIDATION_KINDS = ("classic", "tight", "internet", "moe")


def _cpu_seconds() -> float:
    import resource

    return sum(
        getattr(resource.getrusage(w), f)
        for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for f in ("ru_utime", "ru_stime")
    )


def validation_set(n: int, seed: int = 0) -> list[tuple[Scenario, float]]:
    """``n`` validation scenarios (``VALIDATION_KINDS`` in turn) and a reference throughput each: the
    best of the uniform grid and 200 random valid plans (cheap; the metric only compares checkpoints
    with each other)."""
    from autotune.search.agents.simple import run_random, run_uniform

    rng = validation_rng(seed)
    out = []
    for i in range(n):
        s = draw_scenario(rng, name=f"val{i}", kind=VALIDATION_KINDS[i % len(VALIDATION_KINDS)])
        space = SearchSpace(s.cluster, s.model)
        sim = Simulator(s.cluster, s.model)
        ref = 0.0
        for fn, budget in ((run_uniform, 400), (run_random, 200)):
            ev = BudgetedEvaluator(sim, space, budget)
            fn(space, ev, seed=0)
            ref = max(ref, ev.best.score if ev.best else 0.0)
        out.append((s, ref))
    return out


def validate(policy, scenarios: list[tuple[Scenario, float]], budgets=(5, 13)) -> dict[str, float]:
    """Mean over scenarios of best-found@budget / reference for the greedy policy."""
    ratios: dict[int, list[float]] = {b: [] for b in budgets}
    for s, ref in scenarios:
        space = SearchSpace(s.cluster, s.model)
        ev = BudgetedEvaluator(Simulator(s.cluster, s.model), space, max(budgets))
        run_pretrained(space, ev, seed=0, policy=policy)
        curve = ev.best_curve()
        for b in budgets:
            best = curve[min(b, len(curve)) - 1] if curve else 0.0
            ratios[b].append(best / ref if ref > 0 else 0.0)
    return {f"val_best_at_{b}": float(np.mean(v)) for b, v in ratios.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget")
    ap.add_argument("--timesteps", type=int, default=2_000_000, help="upper bound on env steps")
    ap.add_argument("--n-envs", type=int, default=8)
    ap.add_argument("--subproc", action="store_true", help="one process per env (SubprocVecEnv)")
    ap.add_argument("--n-steps", type=int, default=128, help="rollout length per env between updates")
    ap.add_argument("--episode-evaluations", type=int, default=16)
    ap.add_argument("--random-start-prob", type=float, default=0.3)
    ap.add_argument("--gamma", type=float, default=0.95)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--ent-coef", type=float, default=0.01)
    ap.add_argument("--net", default="128,128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--validate-every", type=int, default=20_000, help="env steps between validations")
    ap.add_argument("--validation-scenarios", type=int, default=10)
    ap.add_argument("--output", default="autotune/data/policy.safetensors")
    ap.add_argument("--init", default=None, help="continue training this policy file")
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    ap.add_argument("--experiment", default="autotune-policy-pretraining")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import mlflow
    import torch
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    torch.set_num_threads(1)
    t0 = time.time()
    cpu0 = _cpu_seconds()
    load0 = os.getloadavg()

    def make(i: int):
        def thunk():
            import torch as _t

            _t.set_num_threads(1)
            return ScenarioEnv(
                seed=args.seed * 1000 + i,
                episode_evaluations=args.episode_evaluations,
                random_start_prob=args.random_start_prob,
            )

        return thunk

    vec_cls = SubprocVecEnv if args.subproc else DummyVecEnv
    venv = vec_cls([make(i) for i in range(args.n_envs)])
    net = [int(x) for x in args.net.split(",")]
    if args.init:
        # weights from the file (autotune.policy.policy_file, no pickle); the optimizer starts fresh
        model = policy_file.load_model(
            args.init,
            venv,
            args.seed,
            widen_layout=True,
            learning_rate=args.lr,
            ent_coef=args.ent_coef,
            gamma=args.gamma,
            n_steps=args.n_steps,
            batch_size=256,
        )
    else:
        model = MaskablePPO(
            "MlpPolicy",
            venv,
            n_steps=args.n_steps,
            batch_size=256,
            n_epochs=4,
            learning_rate=args.lr,
            gamma=args.gamma,
            gae_lambda=0.9,
            ent_coef=args.ent_coef,
            clip_range=0.2,
            seed=args.seed,
            device="cpu",
            verbose=0,
            policy_kwargs={"net_arch": net},
        )
        policy_file.without_log_folder(model)
    log.info("building %d validation scenarios", args.validation_scenarios)
    val = validation_set(args.validation_scenarios)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    last_path = out_path.with_name(out_path.stem + ".last.safetensors")
    deadline = time.time() + 60 * args.minutes  # the training itself, after the validation set is built

    mlflow.set_tracking_uri(args.tracking_uri)
    mlflow.set_experiment(args.experiment)
    with mlflow.start_run(run_name=f"maskableppo-{args.minutes:g}min-seed{args.seed}") as run:
        mlflow.log_params({k: v for k, v in vars(args).items()})
        mlflow.log_params({"obs_dim": int(venv.observation_space.shape[0]), "n_actions": int(venv.action_space.n)})

        class Track(BaseCallback):
            def __init__(self) -> None:
                super().__init__()
                self.next_val = args.validate_every
                self.best_val = -math.inf
                self.episodes = 0
                self.curve: list[tuple[int, float, dict]] = []

            def _check(self) -> None:
                metrics = validate(self.model, val)
                score = metrics["val_best_at_13"] + 0.5 * metrics["val_best_at_5"]
                mlflow.log_metrics(metrics, step=self.num_timesteps)
                self.curve.append((self.num_timesteps, time.time() - t0, metrics))
                log.info(
                    "step %d (%.0f s): %s",
                    self.num_timesteps,
                    time.time() - t0,
                    " ".join(f"{k}={v:.4f}" for k, v in metrics.items()),
                )
                policy_file.save(self.model, last_path, num_timesteps=int(self.num_timesteps))
                if score > self.best_val:
                    self.best_val = score
                    policy_file.save(self.model, out_path, num_timesteps=int(self.num_timesteps))

            def _on_training_start(self) -> None:
                self._check()

            def _on_step(self) -> bool:
                for done in self.locals.get("dones", []):
                    self.episodes += int(done)
                if self.num_timesteps >= self.next_val:
                    self.next_val += args.validate_every
                    self._check()
                return time.time() < deadline

            def _on_rollout_end(self) -> None:
                rewards = self.model.rollout_buffer.rewards
                mlflow.log_metrics(
                    {
                        "rollout_reward_per_step": float(np.mean(rewards)),
                        "episodes": self.episodes,
                        "steps_per_s": self.num_timesteps / max(time.time() - t0, 1e-9),
                    },
                    step=self.num_timesteps,
                )

        track = Track()
        model.learn(total_timesteps=args.timesteps, callback=track)
        track._check()
        train_s = time.time() - t0
        cpu_s = _cpu_seconds() - cpu0
        load1 = os.getloadavg()
        size = out_path.stat().st_size
        mlflow.log_metrics(
            {
                "train_time_s": train_s,
                "timesteps": model.num_timesteps,
                "policy_bytes": size,
                "best_validation_score": track.best_val,
            }
        )
        mlflow.log_artifact(str(out_path))
        meta = {
            "train_time_s": round(train_s, 1),
            "timesteps": int(model.num_timesteps),
            "episodes": track.episodes,
            "command": "python scripts/train_policy.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "cpu": f"{os.cpu_count()} shared CPU cores, torch 1 thread",
            "mlflow_run_id": run.info.run_id,
            "validation": [{"step": st, "seconds": round(sec, 1), **m} for st, sec, m in track.curve],
            "best_validation_score": track.best_val,
            "cpu_s": round(cpu_s, 1),
            "nice": os.nice(0),
            "loadavg_start": [round(x, 2) for x in load0],
            "loadavg_end": [round(x, 2) for x in load1],
            "init": args.init,
        }
        out_path.with_suffix(".json").write_text(json.dumps(meta, indent=2))
        print(
            f"trained {model.num_timesteps} env steps ({track.episodes} episodes) in {train_s:.0f} s wall, "
            f"{cpu_s:.0f} CPU s (nice {os.nice(0)}, load average {load0[0]:.1f} at the start, {load1[0]:.1f} at "
            f"the end); mlflow run {run.info.run_id} in {args.tracking_uri}"
        )
        print("validation (mean best@B / reference over the validation scenarios):")
        for steps, secs, metrics in track.curve:
            print(f"  step {steps:>8d}  {secs:6.0f} s  " + "  ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        print(f"saved the best checkpoint ({size / 1024:.0f} KiB) to {out_path}")
    venv.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
