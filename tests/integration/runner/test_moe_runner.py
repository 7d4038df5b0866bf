"""The runner's MoE block, expert parallelism (all-to-all over gloo) and SPES mode on real CPU ranks.

Four ranks are started once (``torch.multiprocessing.spawn``, ``file://`` rendezvous) and run every
scenario in turn on the engine the runner uses, recording losses and weights after each step:

- expert parallelism (2 groups x 2-stage pipelines with recomputation; 4 replicas x 1 expert each)
  equals single-process training to 1e-5 relative over 6 steps (measured: <= 2e-7);
- SPES mode with ``sync_every_steps`` 1 (explicit expert lists) equals ordinary data parallelism;
- SPES with 4 (each replica trains one expert): after every sync all replicas hold identical shared
  parameters and experts, each replica's untrained experts are untouched between syncs, the loss falls;
- a SPES run checkpointed after step 3 (mid-period) and resumed is bit-exact with the uninterrupted run.

A profiled run (``measure``) of an expert-parallel SPES plan times one synchronisation on its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_ranks import MODEL, build_engine, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6


def _stage(device: str, layers: int, recompute: bool = False) -> dict:
    return {"devices": [device], "layers": layers, "recompute": recompute}


PLANS = {
    "dp": {
        "micro_batch_size": 1,
        "pipelines": [{"num_microbatches": 2, "stages": [_stage(f"cpu:{p}", 4)]} for p in range(4)],
    },
    "ep2-pp2": {
        "micro_batch_size": 1,
        "expert_parallel": 2,
        "pipelines": [
            {"num_microbatches": 4, "stages": [_stage(f"cpu:{2 * p}", 1), _stage(f"cpu:{2 * p + 1}", 3, True)]}
            for p in range(2)
        ],
    },
    "ep4": {
        "micro_batch_size": 1,
        "expert_parallel": 4,
        "pipelines": [{"num_microbatches": 2, "stages": [_stage(f"cpu:{p}", 4)]} for p in range(4)],
    },
    "spes-sync1": {
        "micro_batch_size": 1,
        "pipelines": [
            {"num_microbatches": 2, "trains_experts": [0, 1, 2, 3], "stages": [_stage(f"cpu:{p}", 4)]} for p in range(4)
        ],
    },
    "spes-sync4": {
        "micro_batch_size": 1,
        "sync_every_steps": 4,
        "pipelines": [
            {"num_microbatches": 2, "trains_experts": [p], "stages": [_stage(f"cpu:{p}", 4)]} for p in range(4)
        ],
    },
}
SPES_STEPS = 8


def _engine(name: str, rank: int):
    return build_engine(PLANS[name], rank)


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _worker(rank: int, out: Path) -> dict:
    from runner import checkpoint

    results: dict = {}
    for name in ("dp", "ep2-pp2", "ep4", "spes-sync1"):
        engine = _engine(name, rank)
        results[name] = [engine.step(i).loss for i in range(STEPS)]
    # SPES every 4 steps: weights after each step
    engine = _engine("spes-sync4", rank)
    snaps, losses = [_snapshot(engine)], []
    for i in range(SPES_STEPS):
        losses.append(engine.step(i).loss)
        snaps.append(_snapshot(engine))
    results["spes-sync4"] = {"losses": losses, "snapshots": snaps}
    # checkpoint after step 3 (inside a sync period), resume in a fresh engine, run to step 8
    ckpt = out / "ckpt"
    engine = _engine("spes-sync4", rank)
    for i in range(3):
        engine.step(i)
    checkpoint.save(ckpt, engine, 3)
    engine = _engine("spes-sync4", rank)
    start = checkpoint.load(checkpoint.latest(ckpt), engine)
    results["resumed"] = {
        "start": start,
        "losses": [engine.step(i).loss for i in range(start, SPES_STEPS)],
        "final": _snapshot(engine),
    }
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, tmp_path_factory.mktemp("moe-runs"))


@pytest.fixture(scope="module")
def reference() -> list[float]:
    from runner.reference import reference_losses

    return reference_losses(MODEL, STEPS)


@pytest.mark.parametrize("plan", ["dp", "ep2-pp2", "ep4"])
def test_expert_parallel_trains_like_a_single_process(runs, reference, plan) -> None:
    losses = torch.tensor(runs[0][plan])
    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, torch.tensor(reference), rtol=1e-5, atol=0)


def test_spes_with_sync_every_step_is_ordinary_data_parallelism(runs) -> None:
    torch.testing.assert_close(torch.tensor(runs[0]["spes-sync1"]), torch.tensor(runs[0]["dp"]), rtol=1e-6, atol=0)


def _experts(name: str) -> int | None:
    return int(name.split(".experts.")[1].split(".")[0]) if ".experts." in name else None


def test_spes_sync_every_4_steps(runs) -> None:
    snaps = [r["spes-sync4"]["snapshots"] for r in runs]  # [rank][step] -> state
    names = list(snaps[0][0])
    for step in range(1, SPES_STEPS + 1):
        synced = step % 4 == 0
        for name in names:
            values = [snaps[r][step][name] for r in range(4)]
            e = _experts(name)
            if synced:  # every replica holds the same weights after a sync: shared part and every expert
                for v in values[1:]:
                    assert torch.equal(v, values[0]), (step, name)
            elif e is None and step % 4 == 1:  # trained locally on different data: the replicas differ
                assert not torch.equal(values[0], values[1]), (step, name)
            if e is not None:
                for r in range(4):
                    if r != e and not synced:  # an expert its replica does not train stays as it was
                        assert torch.equal(snaps[r][step][name], snaps[r][step - 1][name]), (step, name, r)
                    if r == e:  # its trainer updates it every step
                        assert not torch.equal(snaps[r][step][name], snaps[r][step - 1][name]), (step, name, r)
    losses = runs[0]["spes-sync4"]["losses"]
    assert losses[-1] < losses[0] - 0.05, losses


def test_spes_resume_is_bit_exact(runs) -> None:
    for r in range(4):
        resumed = runs[r]["resumed"]
        assert resumed["start"] == 3
        assert resumed["losses"] == runs[r]["spes-sync4"]["losses"][3:]
        final = runs[r]["spes-sync4"]["snapshots"][-1]
        for name, value in resumed["final"].items():
            assert torch.equal(value, final[name]), name


def test_measure_times_local_steps_and_one_sync() -> None:
    """A profiled run of an expert-parallel SPES plan (2 groups of 2) under ZeRO-3 (the shared weights sharded
    over each group's two ranks, gathered in turn for the synchronisation): the synchronisation is timed on its
    own and amortised over sync_every_steps in iteration_time_s."""
    from autotune import load_config
    from runner.launch import RealEvaluator

    config = load_config(
        {
            "micro_batch_size": 1,
            "zero": 3,
            "expert_parallel": 2,
            "sync_every_steps": 5,
            "pipelines": [
                {
                    "num_microbatches": 2,
                    "trains_experts": [0, 1] if p < 2 else [2, 3],
                    "stages": [_stage(f"cpu:{p}", 4)],
                }
                for p in range(4)
            ],
        }
    )
    m = RealEvaluator("cpu-4", MODEL, steps=2, warmup=1, timeout_s=240).evaluate(config)
    assert m.status == "ok", m.error
    assert m.sync_time_s > 0 and m.iteration_time_s > m.sync_time_s / 5
    assert m.to_dict()["sync_time_s"] == m.sync_time_s
