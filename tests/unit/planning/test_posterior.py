"""The simulator's errors as reality may have them, and what real runs say about the plans not run yet."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
from simulator_cases import two_nodes

from autotune import load_model
from autotune.planning.posterior import (
    EXTRAPOLATION,
    LINK_PRIOR,
    MAX_DOUBT,
    RUN_NOISE,
    CandidateTable,
    Posterior,
    candidate_table,
    run_noise,
)
from autotune.simulator import Simulator
from autotune.simulator.perturbation import ClusterErrors, draw_errors, perturb
from autotune.specs import ParallelConfig
from envs import REAL_RUNS_ENV_ID
from envs.acquisition import MAX_CANDIDATES, OBSERVATIONS, Episode, RealRunsEnv

PIPELINE = ParallelConfig.from_dict(
    {
        "micro_batch_size": 1,
        "pipelines": [
            {"num_microbatches": 16, "stages": [{"devices": ["a:0"], "layers": 24}, {"devices": ["b:0"], "layers": 24}]}
        ],
    }
)
ONE_GPU = ParallelConfig.from_dict(
    {"micro_batch_size": 1, "pipelines": [{"num_microbatches": 16, "stages": [{"devices": ["a:0"], "layers": 48}]}]}
)


def test_perturb_scales_compute_memory_and_links_as_drawn() -> None:
    model = load_model("gpt2-xl", global_batch_size=16)
    cluster = two_nodes(100.0)
    nominal = Simulator(cluster, model).evaluate(ONE_GPU)
    slow = Simulator(perturb(cluster, ClusterErrors(compute_time={"A100-80GB": 2.0})), model).evaluate(ONE_GPU)
    assert nominal.ok and slow.ok
    assert 1.7 < slow.iteration_time_s / nominal.iteration_time_s <= 2.01  # compute-bound: nearly all of it
    small = perturb(cluster, ClusterErrors(memory={"A100-80GB": 0.1}, network_bandwidth={"a": 0.5}))
    assert small.nodes[0].device.memory_GiB == pytest.approx(cluster.nodes[0].device.memory_GiB * 0.1)
    assert small.nodes[0].network.bandwidth_GBps == pytest.approx(50.0)
    assert small.nodes[0].network.latency_us == pytest.approx(40.0)
    assert small.nodes[1].network.bandwidth_GBps == pytest.approx(100.0)  # a node it does not name: as given
    assert Simulator(small, model).evaluate(ONE_GPU).oom

    a = draw_errors(cluster, "bf16", np.random.default_rng(3))
    assert a == draw_errors(cluster, "bf16", np.random.default_rng(3))  # reproducible
    assert set(a.compute_time) == {"A100-80GB"} and set(a.network_bandwidth) == {"a", "b"}


def test_each_gpu_class_has_its_own_link_terms_measured_at_a_wrong_files_size() -> None:
    """One node type on PCIe where the file says NVLink must be expressible: a term per GPU class's links
    inside its nodes (and its network), with the link prior no narrower than ``LINK_PRIOR``; data parallelism
    over one node's two GPUs depends on that node type's links only."""
    from autotune.loading import cluster_from_dict

    link = {"bandwidth_GBps": 300, "latency_us": 2}
    net = {"bandwidth_GBps": 25, "latency_us": 20}
    cluster = cluster_from_dict(
        {
            "name": "two-types",
            "nodes": [
                {"name": "h", "gpu": "H100-80GB", "count": 2, "intra_node": link, "network": net},
                {"name": "a", "gpu": "A100-80GB", "count": 2, "intra_node": link, "network": net},
            ],
            "network": net,
        },
        "two-types",
    )
    model = load_model("gpt2-xl", global_batch_size=16)
    dp_on_h = ParallelConfig.from_dict(
        {
            "micro_batch_size": 1,
            "pipelines": [{"num_microbatches": 8, "stages": [{"devices": [d], "layers": 48}]} for d in ("h:0", "h:1")],
        }
    )
    table = candidate_table(cluster, model, [dp_on_h], lambda c: Simulator(c, model))
    terms = list(table.terms)
    assert "links inside the H100-80GB nodes" in terms and "links inside the A100-80GB nodes" in terms
    for name in terms:
        if name.startswith(("links", "network")):
            assert table.prior_sigma[terms.index(name)] >= LINK_PRIOR
    sens = dict(zip(terms, table.sensitivity[0]))
    assert sens["links inside the H100-80GB nodes"] > 0.01  # its gradient all-reduce runs over the H100 node's links
    assert sens["links inside the A100-80GB nodes"] == 0.0 and sens["compute on A100-80GB"] == 0.0


def test_a_run_that_separates_terms_teaches_even_when_it_cannot_win() -> None:
    """Candidate 0 ran at its prediction (term 0 known); candidate 3 is predicted as fast but also depends on
    term 1, so it may be faster or slower. Candidates 1 and 2 are 3x slower (neither can win) and alike to
    ``expected_gain``; 1 depends on term 1, so its run tells whether 3 is worth running, 2's on a term no
    other plan has: it teaches nothing."""
    post = Posterior(
        _table(
            [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]],
            [0.3, 0.3, 0.3],
            predicted=(1.0, 3.0, 3.0, 1.0),
            headroom=(0.5, 0.5, 0.5, 0.5),
        )
    )
    post.observe(0, 1.0)
    gain, teach = post.expected_gain(), post.teaching()
    assert gain[1] == pytest.approx(gain[2]) and gain[1] < 1e-3
    assert teach[0] == 0.0  # it ran
    assert teach[1] > 0.05 > 1e-3 > teach[2]
    # by hand: 1's run moves 3's mean by c xi, c = 0.3^2 / sqrt(0.3^2 + noise^2), so the best belief
    # min(0, c xi) falls by c E[max(0, -xi)] = c / sqrt(2 pi) on average
    c = 0.09 / math.sqrt(0.09 + RUN_NOISE**2)
    assert teach[1] == pytest.approx(c / math.sqrt(2 * math.pi), rel=0.05)


def _table(sensitivity, prior_sigma, predicted=(1.0, 2.0), headroom=(0.5, 0.5)) -> CandidateTable:
    k = len(predicted)
    return CandidateTable(
        (),
        np.array(predicted, dtype=float),
        np.full(k, 0.1),
        np.array(headroom, dtype=float),
        np.array(sensitivity, dtype=float),
        np.array(prior_sigma, dtype=float),
        tuple(f"t{i}" for i in range(len(prior_sigma))),
    )


def test_a_run_moves_the_plans_that_share_its_terms_by_hand() -> None:
    """Candidate 0 depends on terms 0 and 1, candidate 1 on term 0 only. Measuring 0 at e^y its
    prediction: z's posterior mean is Sigma A^T (A Sigma A^T + n^2)^-1 y = (a^2, b^2) y / (a^2 + b^2 + n^2)."""
    a, b, n, y = 0.3, 0.4, 0.05, 0.2
    post = Posterior(_table([[1.0, 1.0], [1.0, 0.0]], [a, b]), noise=n)
    assert post.mean_log_s == pytest.approx(np.log([1.0, 2.0]))
    assert post.std_log_s == pytest.approx([math.sqrt(a * a + b * b + n * n), math.sqrt(a * a + n * n)])
    post.observe(0, math.exp(y) * 1.0)
    s = a * a + b * b + n * n
    assert post.mean_log_s[1] == pytest.approx(math.log(2.0) + a * a * y / s)
    # the variance of term 0 shrinks by a^4 / s; the shift the run taught adds EXTRAPOLATION x itself
    shift = a * a * y / s
    assert post.std_log_s[1] == pytest.approx(math.sqrt(a * a - a**4 / s + n * n + (EXTRAPOLATION * shift) ** 2))
    assert post.best_measured_s == pytest.approx(math.exp(y))
    # a failed run says nothing about time
    post.observe(1, None)
    assert post.failed[1] and post.run.all() and post.best_measured_s == pytest.approx(math.exp(y))


def test_the_run_noise_is_what_repeated_runs_showed_and_widens_the_belief() -> None:
    assert run_noise(None) == RUN_NOISE  # nothing ran twice yet
    assert run_noise(0.01) == RUN_NOISE  # runs that agree: never below the floor
    # median max/min - 1 of 36% over the plans run more than once: log(1.36) / (2 / sqrt(pi))
    assert run_noise(0.36) == pytest.approx(math.log(1.36) * math.sqrt(math.pi) / 2)
    post = Posterior(_table([[1.0], [1.0]], [0.0], predicted=(1.0, 1.0)), noise=0.05)
    post.observe(0, 1.0)
    narrow = post.expected_gain()[1]
    post.set_noise(run_noise(0.36))
    assert post.std_log_s[1] == pytest.approx(run_noise(0.36))
    assert post.expected_gain()[1] == pytest.approx(narrow * run_noise(0.36) / 0.05)


def test_expected_gain_and_fit_probability_by_hand() -> None:
    post = Posterior(_table([[1.0], [1.0]], [0.0], predicted=(1.0, 1.0), headroom=(0.0, 0.5)), noise=0.1)
    post.observe(0, 1.0)
    # candidate 1: mean log time = log best, spread 0.1 -> E[max(0, -X)] = 0.1 * phi(0)
    assert post.expected_gain() == pytest.approx([0.0, 0.1 / math.sqrt(2 * math.pi)])
    # a plan using all its memory fits half the time; one with half of it spare nearly always
    fit = post.fit_probability()
    assert fit[0] == pytest.approx(0.5) and fit[1] > 0.999


def test_candidate_table_measures_the_network_sensitivity_where_the_network_matters() -> None:
    model = load_model("gpt2-xl", global_batch_size=16)
    tables = {
        bw: candidate_table(two_nodes(bw), model, [PIPELINE, ONE_GPU], lambda c: Simulator(c, model))
        for bw in (100.0, 0.125)
    }
    for table in tables.values():
        # one GPU per node: no links inside a node to be wrong about
        assert table.terms == ("common", "compute on A100-80GB", "network of the A100-80GB nodes")
        assert list(table.predicted_s) == sorted(table.predicted_s)  # fastest first
        assert np.all(table.sensitivity[:, 0] == 1.0)
    slow, fast = tables[0.125], tables[100.0]
    pipe_slow = slow.configs.index(PIPELINE)
    pipe_fast = fast.configs.index(PIPELINE)
    one = fast.configs.index(ONE_GPU)
    assert slow.sensitivity[pipe_slow, 2] > 2 * fast.sensitivity[pipe_fast, 2]
    assert fast.sensitivity[one, 2] == 0.0  # one GPU sends nothing over the network
    assert 0.8 < fast.sensitivity[one, 1] <= 1.02  # and is compute-bound
    # the link prior is a wrong file's (LINK_PRIOR), at least the simulator's own network error bar
    assert slow.prior_sigma[2] >= fast.prior_sigma[2] >= LINK_PRIOR


def test_the_env_rewards_minus_the_regret_of_each_run_and_masks_what_ran() -> None:
    table = _table([[1.0], [1.0], [1.0]], [0.3], predicted=(1.0, 1.1, 1.2), headroom=(0.5, 0.5, 0.5))
    env = RealRunsEnv([Episode(table, np.array([1.6, 0.8, math.nan]))], budget=2)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (OBSERVATIONS,) and env.observation_space.contains(obs)
    assert list(env.action_masks()) == [True, True, True] + [False] * (MAX_CANDIDATES - 3)
    obs, reward, done, _, _ = env.step(0)
    assert reward == pytest.approx(0.8 / 1.6 - 1.0) and not done
    assert not env.action_masks()[0]
    with pytest.raises(ValueError, match="not open"):
        env.step(0)
    obs, reward, done, _, _ = env.step(1)
    assert reward == 0.0 and done  # the best plan ran; the budget of 2 is spent
    env.reset()
    _, reward, _, _, _ = env.step(2)
    assert reward == -1.0  # nothing ran yet
    made = gym.make(REAL_RUNS_ENV_ID, episodes=env.episodes, budget=2)
    assert made.reset(seed=1)[0].shape == (OBSERVATIONS,)


def test_a_run_outside_its_error_bar_widens_the_bars_and_the_expected_gains() -> None:
    """Two candidates, each on its own term of spread 0.05: the first runs 2x slower than predicted (z ~ 14),
    so the bars were too narrow here; the belief widens (``doubt`` at its cap) for the second too, whose term no
    run measured (and with it the gain the rule expects of it)."""
    a, n = 0.05, 0.01
    calm = Posterior(_table([[1.0, 0.0], [0.0, 1.0]], [a, a], predicted=(1.0, 1.1)), noise=n)
    calm.observe(0, 1.02)  # within its bar: no doubt
    assert calm.doubt == 1.0 and calm.explains()
    post = Posterior(_table([[1.0, 0.0], [0.0, 1.0]], [a, a], predicted=(1.0, 1.1)), noise=n)
    post.observe(0, 2.0)
    assert post.doubt == MAX_DOUBT
    assert post.std_log_s[1] > 3 * calm.std_log_s[1]


def test_the_belief_explains_the_runs_or_says_it_does_not() -> None:
    """Two plans the terms move alike, measured 1.0 and 2.0 where both were predicted 1.0: no setting of the
    shared term explains both, and the stopping rule must not trust it."""
    post = Posterior(_table([[1.0], [1.0]], [0.3], predicted=(1.0, 1.0)), noise=0.02)
    post.observe(0, 1.0)
    assert post.explains()
    post.observe(1, 2.0)
    assert not post.explains()
