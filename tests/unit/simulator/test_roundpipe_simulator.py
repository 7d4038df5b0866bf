"""RoundPipe's dispatch schedule (autotune.simulator.roundpipe) on hand-computed cases."""

from __future__ import annotations

import pytest
from paths import EXAMPLES

from autotune import load_cluster, load_config, load_model
from autotune.loading import cluster_from_dict
from autotune.simulator import Simulator
from autotune.simulator import roundpipe as rps
from autotune.simulator.memory import GiB
from autotune.simulator.roundpipe import StageWork, run_dispatch
from autotune.simulator.roundpipe_partition import auto_partition, auto_stages
from autotune.specs import ModelSpec, ParallelConfig, PipelineConfig
from autotune.specs.roundpipe import RoundPipeStages

EXAMPLES = EXAMPLES


def _stages(n_fwd, n_bwd, compute=1.0, params=0.0, act=0.0, head=None):
    """Synthetic stages in hand-out order: forward, fused, backward (last first)."""
    out = [StageWork(f"F{k}", compute, params, 0.0, act, act, 0.0, 0.0) for k in range(n_fwd)]
    out.append(StageWork("FB", compute if head is None else head, params, params, act, act, 0.0, 0.0))
    out += [StageWork(f"B{k}", compute, params, params, act, act, 0.0, 0.0) for k in range(n_bwd - 1, -1, -1)]
    return out


GPUS4 = [f"g:{i}" for i in range(4)]


@pytest.mark.parametrize("n_gpus, n_fwd, n_bwd, m", [(4, 4, 4, 16), (4, 3, 4, 16), (8, 8, 8, 32), (8, 10, 12, 64)])
def test_equal_stages_and_a_free_link_leave_no_bubble(n_gpus, n_fwd, n_bwd, m):
    stages = _stages(n_fwd, n_bwd)
    res = run_dispatch(stages, [f"g:{i}" for i in range(n_gpus)], m, 1, 1e6, 0.0)
    ideal = len(stages) * m * 1.0 / n_gpus  # all the work, spread evenly: consecutive iterations overlap
    assert res.period_s == pytest.approx(ideal, rel=1e-6)
    assert max(res.busy_s.values()) == pytest.approx(min(res.busy_s.values()), rel=1e-6)


@pytest.mark.parametrize("n_gpus, n_fwd, n_bwd, m, bw", [(4, 3, 4, 16, 1.0), (4, 4, 4, 16, 2.0), (8, 8, 8, 8, 0.5)])
def test_a_slow_link_makes_the_upload_the_bottleneck_at_exactly_its_rate(n_gpus, n_fwd, n_bwd, m, bw):
    # 1 GB of parameters per stage over bw GB/s, compute 1 ms per micro-batch, activations 1 kB
    stages = _stages(n_fwd, n_bwd, compute=1e-3, params=1e9, act=1e3)
    res = run_dispatch(stages, [f"g:{i}" for i in range(n_gpus)], m, 1, bw, 0.0)
    # host -> GPU per iteration, spread over the GPUs: every stage's 1 GB and m inputs of 1 kB each
    upload_s = len(stages) * (1e9 + m * 1e3) / (bw * 1e9) / n_gpus
    assert res.period_s == pytest.approx(upload_s, rel=1e-4)
    compute_s = len(stages) * m * 1e-3 / n_gpus
    assert res.period_s > 10 * compute_s


def test_uploads_hide_behind_compute_when_the_link_allows():
    # the same stages, 1 GB each, at 25 GB/s (40 ms) against 16 x 1 s of compute: nothing shows
    stages = _stages(4, 4, compute=1.0, params=1e9, act=1e6)
    res = run_dispatch(stages, GPUS4, 16, 1, 25.0, 10.0)
    assert res.period_s == pytest.approx(9 * 16 / 4, rel=1e-3)


def test_shared_pcie_root_divides_the_nodes_host_bandwidth():
    def cluster(link, extra):
        return cluster_from_dict(
            {
                "nodes": [
                    {
                        "name": "box",
                        "gpu": "RTX-4090",
                        "count": 4,
                        "host": {"memory_GiB": 512, "link": {"bandwidth_GBps": link}, **extra},
                    }
                ],
                "network": {"bandwidth_GBps": 10},
            },
            "t",
        )

    model = load_model("llama2-7b", 8)
    plan = load_config(
        {
            "micro_batch_size": 1,
            "schedule": "roundpipe",
            "pipelines": [
                {
                    "num_microbatches": 8,
                    "devices": [f"box:{i}" for i in range(4)],
                    "forward_layers": [8, 8, 8],
                    "fused_layers": 8,
                    "backward_layers": [8, 8, 8],
                }
            ],
        }
    )
    own = Simulator(cluster(0.5, {}), model).evaluate(plan)
    # a 1 GB/s root shared by the 4 GPUs leaves each 0.25 GB/s of its 0.5 GB/s link ...
    shared = Simulator(cluster(0.5, {"bandwidth_GBps": 1.0}), model).evaluate(plan)
    quarter = Simulator(cluster(0.25, {}), model).evaluate(plan)
    assert own.ok and shared.ok and quarter.ok
    assert shared.iteration_time_s == pytest.approx(quarter.iteration_time_s, rel=1e-12)  # ... exactly that
    assert shared.iteration_time_s > 1.5 * own.iteration_time_s
    roomy = Simulator(cluster(0.5, {"bandwidth_GBps": 100.0}), model).evaluate(plan)
    assert roomy.iteration_time_s == pytest.approx(own.iteration_time_s, rel=1e-12)  # a wide root changes nothing


def test_a_heavy_lm_head_does_not_pin_one_gpu():
    # a 250k vocabulary: the head costs several blocks; RoundPipe's own partition sizes the other stages
    # to it and the round-robin moves it to another GPU every iteration: every GPU does the same work
    cluster = load_cluster(EXAMPLES / "8x4090.yaml")
    model = ModelSpec("big-vocab", 32, 4096, 32, 11008, 250_000, 2048, 64, mlp="swiglu")
    sim = Simulator(cluster, model)
    rp = auto_stages(sim.costs, cluster.device_ids(), 1)
    res = run_dispatch(rps.pass_stages(sim.costs, rp, 1, "box:0"), cluster.device_ids(), 64, 1, 25.0, 10.0)
    busy = list(res.busy_s.values())
    assert max(busy) / (sum(busy) / len(busy)) < 1.01
    fb = next(st for st in rps.pass_stages(sim.costs, rp, 1, "box:0") if st.label == "FB")
    lf = sim.costs.unit_costs("box:0", 1)[0]
    assert fb.compute_s > 4 * lf  # the head stage is heavy ...
    # ... and yet the GPUs stay busy (measured: 12.5% idle, from stages of unequal length, not the head)
    assert 1 - (sum(busy) / len(busy)) / res.period_s < 0.15

    # bound to GPUs (1F1B, 4 blocks per GPU), the GPU with the head does the most work every iteration
    def work(last):
        est = sim.costs.stage_estimate(("box:7",), 4, True, False, last, 1, 1)
        return est.forward_s + est.backward_s

    assert work(True) > 1.3 * work(False)


def test_memory_per_gpu_and_on_the_host_against_a_hand_count():
    cluster = load_cluster(EXAMPLES / "8x4090.yaml")
    h, f, V, s, L = 1024, 4096, 8000, 512, 6
    model = ModelSpec("hand", L, h, 8, f, V, s, 8, mlp="gelu")
    sim = Simulator(cluster, model)
    rp = RoundPipeStages(("box:0", "box:1"), (2, 2), (2, 2), 2, "stage")
    cfg = ParallelConfig(2, (PipelineConfig(4, (), None, rp),), "roundpipe")
    m = sim.evaluate(cfg)
    assert m.ok, m.error
    # by hand, 16-bit everything, micro-batch b = 2
    b = 2
    P = 2 * (4 * h * h + 2 * h * f + 2 * h)  # one block's bytes: Q, K, V, O, two MLP matrices, two norms
    E = 2 * V * h  # the embedding's bytes
    H = 2 * (V * h + h)  # the head and final norm
    act = 2 * b * s * h  # a hidden state
    # Korthikanti's terms in 16 bits, no dropout, flash attention: two norm inputs and the attention and
    # MLP inputs (4 x 2 s b h), Q (2), K and V (2 + 2), the output projection's input (2), GeLU's two (2 x 2 f)
    block_act = s * b * (8 * h + 2 * h + 4 * h + 2 * h + 4 * f)
    logits = 10 * b * s * V  # one loss chunk (b s = 1024 tokens < 4096) at 10 bytes per logit
    # stages handed out: F0 (embedding + 2 blocks), F1 (2), FB (2 + head), B1 (2), B0 (embedding + 2)
    state = {"F0": E + 2 * P, "F1": 2 * P, "FB": 2 * (2 * P + H), "B1": 2 * 2 * P, "B0": 2 * (E + 2 * P)}
    acts = {
        "F0": block_act + 2 * act,
        "F1": block_act + 2 * act,
        "FB": 2 * block_act + logits + 2 * act,
        "B1": 2 * block_act + 2 * act,
        "B0": 2 * block_act + 2 * act,
    }
    order = ["F0", "F1", "FB", "B1", "B0"]
    # two GPUs, five stages: every GPU gets every stage; the stage after stage i on its GPU is i + 2
    worst = max(state[x] + acts[x] + state[order[(i + 2) % 5]] for i, x in enumerate(order))
    assert m.peak_memory_GiB["box:0"] == pytest.approx(worst / GiB, rel=1e-9)
    assert m.peak_memory_GiB["box:1"] == pytest.approx(worst / GiB, rel=1e-9)
    # host: 20 bytes per parameter, plus one pass's kept inputs (B0's token ids, B1's input: block 2's) and
    # one hidden state per micro-batch in flight
    params = L * (4 * h * h + 2 * h * f + 2 * h) + 2 * V * h + h
    kept = 8 * b * s + act
    assert m.host_memory_GiB["box"] == pytest.approx((20 * params + 4 * (kept + act)) / GiB, rel=1e-9)


def test_a_plan_over_the_memory_limit_or_the_gpu_is_refused_with_the_numbers():
    cluster = load_cluster(EXAMPLES / "8x4090.yaml")
    model = load_model("llama2-13b", 64)
    sim = Simulator(cluster, model)
    pool = cluster.device_ids()
    big = RoundPipeStages(pool, (20,), (20,), 20, "stage")
    m = sim.evaluate(ParallelConfig(1, (PipelineConfig(64, (), None, big),), "roundpipe"))
    assert m.status == "invalid" and "over half of memory_limit_GiB 13.41" in m.error and "stage F0" in m.error
    wide = RoundPipeStages(pool, (20,), (20,), 20, "stage", memory_limit_GiB=22.0)
    m = sim.evaluate(ParallelConfig(1, (PipelineConfig(64, (), None, wide),), "roundpipe"))
    assert m.status == "invalid"  # 20 blocks of 13B in one stage: 12 GiB of weights alone
    fine = auto_stages(sim.costs, pool, 32)
    m = sim.evaluate(ParallelConfig(32, (PipelineConfig(2, (), None, fine),), "roundpipe"))
    assert m.status == "oom" and "out of memory" in m.error  # 32 x 4096 tokens of one block's activations


def test_auto_partition_follows_roundpipe_on_a_worked_example():
    # units: embedding, 6 blocks, head. Forward 1 per block, backward 3, the head 2 forward and 6 in all.
    fwd = [0.1] + [1.0] * 6 + [2.0]
    bwd = [0.2] + [3.0] * 6 + [6.0]
    size = [1.0] * 8
    p = auto_partition(fwd, bwd, size, [2 * x for x in size], min_stages=4, upper_threshold=1.1)
    # the slowest unit is the head (6); runs summing to 6..6.6 are 6 (six forward blocks, two backward
    # blocks, the head), 6.1 (embedding + six forward blocks) and 6.2 (embedding + two backward blocks).
    # W = 6: fused = the head alone, forward [emb] [6 blocks], backward [emb+1] [2] [2] [1]: 7 stages, 42;
    # W = 6.1: forward [emb + 6 blocks], backward as for 6: 6 stages, 36.6;
    # W = 6.2: forward [emb + 6], backward [emb + 2] [2] [2]: 5 stages (>= min_stages 4), 31: the least
    assert p.stage_workload_s == pytest.approx(6.2)
    assert (p.forward_layers, p.fused_layers, p.backward_layers) == ((6,), 0, (2, 2, 2))
    # a memory limit of 8 bytes: at most 4 bytes (two units' parameters + gradients) per stage
    q = auto_partition(fwd, bwd, size, [2 * x for x in size], min_stages=4, upper_threshold=1.1, memory_limit_bytes=8.0)
    assert max(q.forward_layers) <= 4 and max(q.backward_layers) <= 2
    assert sum(q.forward_layers) + q.fused_layers == 6 == sum(q.backward_layers) + q.fused_layers


def test_auto_plans_simulate_with_balanced_stages_and_a_small_bubble():
    cluster = load_cluster(EXAMPLES / "8x4090.yaml")
    model = load_model("llama2-13b", 64)
    sim = Simulator(cluster, model)
    rp = auto_stages(sim.costs, cluster.device_ids(), 1)
    cfg = ParallelConfig(1, (PipelineConfig(64, (), None, rp),), "roundpipe")
    m = sim.evaluate(cfg)
    assert m.ok and m.bubble_fraction < 0.05
    assert set(m.peak_memory_GiB) == set(cluster.device_ids()) and m.host_memory_GiB["box"] > 20 * 13e9 / GiB
    d = sim.evaluate_detailed(cfg)
    assert d.tokens_per_s == m.tokens_per_s
    ops = {e.op.split(".")[0] for e in d.timeline}
    assert {"F0", "FB", "B0"} <= ops and any(e.op.startswith("upload") for e in d.timeline)
