"""Hand-offs between stages of different tensor-parallel degrees (``autotune.specs.handoff``): which rank
sends what, worked out by hand, and what the simulator's ``CostModel.p2p`` charges for it."""

from __future__ import annotations

import pytest
from simulator_cases import GPT

from autotune.loading import cluster_from_dict, model_from_dict
from autotune.simulator.collectives import send_s
from autotune.simulator.cost_model import CostModel
from autotune.specs.handoff import Transfer, busiest_fraction, handoff, total_fraction


def test_same_layout_is_rank_to_rank() -> None:
    assert handoff(2, False, 2, False) == (Transfer(0, 0, 0, 1, 1), Transfer(1, 1, 0, 1, 1))
    # sequence parallel on both sides: rank i sends its own half to rank i
    assert handoff(2, True, 2, True) == (Transfer(0, 0, 0, 1, 2), Transfer(1, 1, 1, 2, 2))
    assert handoff(1, False, 1, True) == (Transfer(0, 0, 0, 1, 1),)  # sp on one device is no split


def test_tp2_to_tp1_and_back() -> None:
    # whole activations: sender 0 sends it, sender 1 sends nothing
    assert handoff(2, False, 1, False) == (Transfer(0, 0, 0, 1, 1),)
    # the gradient goes back to both senders (roles swapped): the receiver sends it twice
    back = handoff(1, False, 2, False)
    assert back == (Transfer(0, 0, 0, 1, 1), Transfer(0, 1, 0, 1, 1))
    assert busiest_fraction(back) == 2.0 and total_fraction(back) == 2.0
    # sequence parallel sender: the receiver gathers one half from each
    sp = handoff(2, True, 1, False)
    assert sp == (Transfer(0, 0, 0, 1, 2), Transfer(1, 0, 1, 2, 2))
    assert busiest_fraction(sp) == 1.0 and total_fraction(sp) == 1.0
    # its gradient: each sender gets back the gradient of its own half only
    assert handoff(1, False, 2, True) == (Transfer(0, 0, 0, 1, 2), Transfer(0, 1, 1, 2, 2))


def test_tp4_sequence_parallel_to_tp2_sequence_parallel() -> None:
    # receiver j needs half j = quarters 2j, 2j+1, held by senders 2j and 2j+1
    assert handoff(4, True, 2, True) == (
        Transfer(0, 0, 0, 1, 4),
        Transfer(1, 0, 1, 2, 4),
        Transfer(2, 1, 2, 3, 4),
        Transfer(3, 1, 3, 4, 4),
    )
    # tp 2 whole -> tp 4 sequence parallel: receiver j takes its quarter from sender j mod 2
    assert handoff(2, False, 4, True) == tuple(Transfer(j % 2, j, j, j + 1, 4) for j in range(4))
    assert Transfer(1, 3, 3, 4, 4).tokens(64) == (48, 64)
    with pytest.raises(ValueError):
        handoff(0, False, 1, False)


def _two_nodes(per_node: int):
    gpu = {"name": "X", "peak_tflops": 100.0, "memory_GiB": 80.0, "memory_bandwidth_GBps": 1000.0}
    fast = {"bandwidth_GBps": 100.0, "latency_us": 0.0}
    return cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                {"name": "a", "count": per_node, "gpu": gpu, "intra_node": fast},
                {"name": "b", "count": per_node, "gpu": gpu, "intra_node": fast},
            ],
            "network": {"bandwidth_GBps": 1.0, "latency_us": 0.0},
        },
        "t",
    )


def test_p2p_over_the_network_charges_what_the_node_sends() -> None:
    model = model_from_dict({**GPT, "precision": "bf16"}, "gpt")
    costs = CostModel(_two_nodes(2), model)
    whole = 2 * 1 * model.seq_len * model.hidden_size  # bf16, one sequence
    a2, b1, b2 = ("a:0", "a:1"), ("b:0",), ("b:0", "b:1")

    def net(nbytes: float) -> float:
        return send_s(nbytes, 1.0, 0.0, "network")

    assert costs.p2p(a2, b2, 1) == pytest.approx(net(2 * whole))  # each rank's whole tensor, one NIC
    assert costs.p2p(a2, b2, 1, True) == pytest.approx(net(whole))  # halves
    assert costs.p2p(a2, b1, 1) == pytest.approx(net(whole))  # tp 2 -> tp 1: sender 0 only
    assert costs.p2p(b1, a2, 1) == pytest.approx(net(2 * whole))  # its gradient back to both
    assert costs.p2p(a2, b1, 1, True, False) == pytest.approx(net(whole))  # two halves
    assert costs.p2p(b1, a2, 1, False, True) == pytest.approx(net(whole))  # each its half's gradient


def test_p2p_inside_a_node_is_set_by_the_busiest_rank() -> None:
    model = model_from_dict({**GPT, "precision": "bf16"}, "gpt")
    costs = CostModel(_two_nodes(4), model)
    whole = 2 * model.seq_len * model.hidden_size
    kind = costs.group_kind(("a:0", "a:1"))  # the node's own link kind
    one = send_s(whole, 100.0, 0.0, kind)
    assert costs.p2p(("a:0", "a:1"), ("a:2", "a:3"), 1) == pytest.approx(one)
    # tp 1 -> tp 2 inside the node: the sender sends its tensor twice
    assert costs.p2p(("a:0",), ("a:2", "a:3"), 1) == pytest.approx(send_s(2 * whole, 100.0, 0.0, kind))
