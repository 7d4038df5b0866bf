"""ZeRO sharding of MoE and SPES plans in the runner: torch's FSDP2 (``runner.fsdp``, experts sharded over
their holders) where every holder trains every step, ``runner.zero``'s units (``Layout.key_trainers``) for SPES.

Four CPU ranks are started once and run every scenario on the engine the runner uses:

- on FSDP2, ZeRO 1, 2 and 3 (and 3 with offload ``all``) with expert parallelism (each expert held by two
  replicas, whose shards they split; a 2-stage pipeline with ZeRO 1, each expert held by one rank) and SPES with
  ``sync_every_steps`` 1 (ordinary data parallelism) train like a single process to 1e-5 relative over 6 steps,
  losses and gradient norms (clipped: a gradient scaled wrongly shows in the norm, which Adam's steps hide);
  the ZeRO-3 run checkpointed at step 3 resumes bit-exact; the same ZeRO-3 plan on ``runner.zero`` too;
- SPES with 4 (each replica trains one expert) and ZeRO 2 trains as the same plan without ZeRO (the
  units of one expert-parallel group, the masters reloaded after each synchronisation), and a run
  checkpointed mid-period and resumed is bit-exact (frozen experts saved beside the shards);
- the same with offload ``all`` (every unit streamed from host memory), and SPES over two expert-parallel
  groups of two ranks with ZeRO 3 (the shared weights streamed, sharded over each group's two ranks): the
  synchronisation gathers each unit's weights in turn, averages them and writes the shards back
  (``ShardedState.in_turn``), training as the plan without ZeRO; the ZeRO-3 run resumes bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_ranks import MODEL, build_engine, run_ranks

from runner.optim import TrainSettings

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6
SPES_STEPS = 8
CLIP = TrainSettings(clip_grad_norm=0.5)


def _pipelines(stages=1, trains=None, offload="none") -> list[dict]:
    if stages == 2:
        return [
            {
                "num_microbatches": 4,
                "stages": [{"devices": [f"cpu:{2 * p}"], "layers": 1}, {"devices": [f"cpu:{2 * p + 1}"], "layers": 3}],
            }
            for p in range(2)
        ]
    return [
        {"num_microbatches": 2, "stages": [{"devices": [f"cpu:{p}"], "layers": 4, "offload": offload}]}
        | ({"trains_experts": trains[p]} if trains else {})
        for p in range(4)
    ]


PLANS = {
    "ep2-pp2-zero1": {"micro_batch_size": 1, "zero": 1, "expert_parallel": 2, "pipelines": _pipelines(2)},
    "ep2-zero2": {"micro_batch_size": 1, "zero": 2, "expert_parallel": 2, "pipelines": _pipelines()},
    "ep2-zero3": {"micro_batch_size": 1, "zero": 3, "expert_parallel": 2, "pipelines": _pipelines()},
    "ep2-zero3-offload-all": {
        "micro_batch_size": 1,
        "zero": 3,
        "expert_parallel": 2,
        "pipelines": _pipelines(offload="all"),
    },
    "spes-sync1-zero2": {"micro_batch_size": 1, "zero": 2, "pipelines": _pipelines(trains=[[0, 1, 2, 3]] * 4)},
    "spes-sync4": {
        "micro_batch_size": 1,
        "sync_every_steps": 4,
        "pipelines": _pipelines(trains=[[p] for p in range(4)]),
    },
    "spes-sync4-zero2": {
        "micro_batch_size": 1,
        "zero": 2,
        "sync_every_steps": 4,
        "pipelines": _pipelines(trains=[[p] for p in range(4)]),
    },
    "spes-sync4-zero2-offload-all": {
        "micro_batch_size": 1,
        "zero": 2,
        "sync_every_steps": 4,
        "pipelines": _pipelines(trains=[[p] for p in range(4)], offload="all"),
    },
}
# SPES over two expert-parallel groups of two ranks, each group training two of the four experts, weights
# averaged every 2 steps; without ZeRO and with ZeRO 3
SPES_EP2 = {
    "micro_batch_size": 1,
    "expert_parallel": 2,
    "sync_every_steps": 2,
    "pipelines": _pipelines(trains=[[0, 1], [0, 1], [2, 3], [2, 3]]),
}
PLANS["spes-ep2-sync2"] = SPES_EP2
PLANS["spes-ep2-sync2-zero3"] = SPES_EP2 | {"zero": 3}


# on FSDP2, and one of them on runner.zero
FSDP2 = ("ep2-pp2-zero1", "ep2-zero2", "ep2-zero3", "ep2-zero3-offload-all", "spes-sync1-zero2")
ON_RUNNER_ZERO = "ep2-zero3@runner.zero"


def _engine(name: str, rank: int, **options):
    return build_engine(PLANS[name], rank, **options)


def _clipped_run(engine, start: int = 0) -> tuple[list[float], list[float]]:
    steps = [engine.step(i) for i in range(start, STEPS)]
    return [s.loss for s in steps], [s.grad_norm for s in steps]


def _worker(rank: int, out: Path) -> dict:
    from runner import checkpoint

    results: dict = {}
    for name in FSDP2:
        engine = _engine(name, rank, settings=CLIP)
        assert engine.fsdp and engine.zero is None and engine.expert_sync is None, name
        results[name], results[name + "-norms"] = _clipped_run(engine)
    engine = _engine("ep2-zero3", rank, settings=CLIP, fsdp=False)
    assert engine.zero is not None
    results[ON_RUNNER_ZERO], results[ON_RUNNER_ZERO + "-norms"] = _clipped_run(engine)
    engine = _engine("ep2-zero3", rank, settings=CLIP)  # FSDP2's sharded checkpoint, resumed
    for i in range(3):
        engine.step(i)
    checkpoint.save(out / "ckpt-ep2-zero3", engine, 3)
    engine = _engine("ep2-zero3", rank, settings=CLIP)
    start = checkpoint.load(checkpoint.latest(out / "ckpt-ep2-zero3"), engine)
    results["ep2-zero3-resumed"], _ = _clipped_run(engine, start)
    for name in ("spes-sync4", "spes-sync4-zero2", "spes-sync4-zero2-offload-all", "spes-ep2-sync2"):
        engine = _engine(name, rank)
        results[name] = [engine.step(i).loss for i in range(SPES_STEPS)]
        results[name + "-weights"] = _weights(engine)
    engine = _engine("spes-ep2-sync2-zero3", rank)
    assert engine.zero.streamed
    results["spes-ep2-sync2-zero3"] = [engine.step(i).loss for i in range(SPES_STEPS)]
    results["spes-ep2-sync2-zero3-weights"] = _weights(engine)
    for name, stop in (("spes-sync4-zero2", 3), ("spes-ep2-sync2-zero3", 3)):
        ckpt = out / f"ckpt-{name}"
        engine = _engine(name, rank)
        for i in range(stop):
            engine.step(i)
        checkpoint.save(ckpt, engine, stop)
        engine = _engine(name, rank)
        start = checkpoint.load(checkpoint.latest(ckpt), engine)
        results[f"{name}-resumed"] = [engine.step(i).loss for i in range(start, SPES_STEPS)]
    return results


def _weights(engine) -> dict:
    for u in engine.zero.units if engine.zero is not None else ():  # streamed weights gathered to be read
        u.materialise()
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, tmp_path_factory.mktemp("moe-zero-runs"))


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], list[float]]:
    from runner.reference import reference_losses

    norms: list[float] = []
    return reference_losses(MODEL, STEPS, settings=CLIP, grad_norms=norms), norms


@pytest.mark.parametrize("plan", [*FSDP2, ON_RUNNER_ZERO])
def test_zero_with_experts_trains_like_a_single_process(runs, reference, plan) -> None:
    losses, norms = reference
    torch.testing.assert_close(torch.tensor(runs[0][plan]), torch.tensor(losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(runs[0][plan + "-norms"]), torch.tensor(norms), rtol=1e-5, atol=0)


def test_zero_3_with_experts_on_fsdp2_resumes_bit_exact(runs) -> None:
    for r in range(4):
        assert runs[r]["ep2-zero3-resumed"] == runs[r]["ep2-zero3"][3:]


@pytest.mark.parametrize(
    ("plan", "without"),
    [
        ("spes-sync4-zero2", "spes-sync4"),
        ("spes-sync4-zero2-offload-all", "spes-sync4"),
        ("spes-ep2-sync2-zero3", "spes-ep2-sync2"),
    ],
)
def test_spes_with_zero_trains_as_without_and_resumes_exactly(runs, plan, without) -> None:
    torch.testing.assert_close(torch.tensor(runs[0][plan]), torch.tensor(runs[0][without]), rtol=1e-5, atol=0)
    for r in range(4):  # after the last synchronisation every rank holds what the plan without ZeRO holds
        got, want = runs[r][f"{plan}-weights"], runs[r][f"{without}-weights"]
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5)
        if f"{plan}-resumed" in runs[r]:
            assert runs[r][f"{plan}-resumed"] == runs[r][plan][3:]
