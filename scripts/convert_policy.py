"""Convert a Stable-Baselines3 MaskablePPO ``.zip`` into autotune's pickle-free policy file, and record
what the original does so a test can check the converted file does the same.

    .venv/bin/python scripts/convert_policy.py OLD.zip autotune/data/policy.safetensors \
        [--reference tests/data/policy_reference.json]

ONLY for a zip you made yourself: ``MaskablePPO.load`` unpickles its entries, which runs whatever code
they hold. autotune itself never reads such a file (``autotune.policy.policy_file``).

The reference records, on the fixed scenario of tests/unit/policy/test_pretrained_policy.py (mixed-h100-a100-32,
llama2-13b, global batch 256) and two held-out scenarios: every (observation, mask) the original policy
was asked about during ``run_pretrained`` walks (budget 12, seeds 0-2), its greedy move and action
probabilities, and each walk's sequence of evaluated plans.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from autotune.loading import load_cluster, load_model
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.space import SearchSpace
from autotune.policy import policy_file
from autotune.policy.pretrained import run_pretrained
from autotune.policy.scenarios import heldout_scenarios
from autotune.search.tracking import config_key
from autotune.simulator import Simulator

BUDGET = 12
SEEDS = (0, 1, 2)


class Recorder:
    """Answers like ``policy`` and records each question and answer."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.asked: list[dict] = []

    def predict(self, obs, action_masks=None, deterministic=True):
        import torch

        action, state = self.policy.predict(obs, action_masks=action_masks, deterministic=deterministic)
        with torch.no_grad():
            dist = self.policy.get_distribution(self.policy.obs_to_tensor(obs)[0], action_masks=action_masks)
            probs = dist.distribution.probs[0].numpy()
        self.asked.append(
            {
                "obs": [float(f"{x:.9g}") for x in np.asarray(obs, dtype=np.float32)],
                "mask": [int(i) for i in np.flatnonzero(action_masks)],
                "action": int(action),
                "probs": [float(f"{p:.6g}") for p in probs],
            }
        )
        return action, state


def scenarios():
    yield "mixed-h100-a100-32/llama2-13b", load_cluster("mixed-h100-a100-32"), load_model("llama2-13b", 256)
    for s in heldout_scenarios()[:2]:
        yield s.name, s.cluster, s.model


def record(policy) -> dict:
    walks = []
    for name, cluster, model in scenarios():
        space, sim = SearchSpace(cluster, model), Simulator(cluster, model)
        for seed in SEEDS:
            rec = Recorder(policy)
            ev = BudgetedEvaluator(sim, space, BUDGET)
            run_pretrained(space, ev, seed, policy=rec)
            walks.append(
                {
                    "scenario": name,
                    "seed": seed,
                    "asked": rec.asked,
                    "plans": [config_key(e.config) for e in ev.history],
                }
            )
    return {"budget": BUDGET, "walks": walks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="a MaskablePPO .zip you trust")
    ap.add_argument("output", help="where to write the policy file")
    ap.add_argument("--reference", default=None, help="also record the original's moves here (JSON)")
    args = ap.parse_args(argv)

    import torch
    from sb3_contrib import MaskablePPO

    torch.set_num_threads(1)
    model = MaskablePPO.load(args.source, device="cpu")
    policy_file.save(model, args.output, num_timesteps=int(model.num_timesteps))
    print(
        f"wrote {args.output} ({Path(args.output).stat().st_size / 1024:.0f} KiB, from "
        f"{Path(args.source).stat().st_size / 1024:.0f} KiB)"
    )
    if args.reference:
        ref = record(model.policy)
        Path(args.reference).write_text(json.dumps(ref, separators=(",", ":")) + "\n")
        asked = sum(len(w["asked"]) for w in ref["walks"])
        print(f"recorded {asked} moves over {len(ref['walks'])} walks in {args.reference}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
