"""Communication costs: ring all-reduce and point-to-point transfers (alpha-beta model).

Ring all-reduce of ``n`` bytes among ``k`` ranks moves ``2 (k - 1) / k * n`` bytes through every rank's
link in ``2 (k - 1)`` steps (Patarasuk & Yuan 2009; the NCCL "bus bandwidth" convention), so it takes
``2 (k - 1) / k * n / bandwidth + 2 (k - 1) * latency``.
"""

from __future__ import annotations

from autotune.specs import LinkSpec


def ring_allreduce_s(num_bytes: float, ranks: int, bandwidth_GBps: float, latency_us: float) -> float:
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * num_bytes / (bandwidth_GBps * 1e9) + 2.0 * (ranks - 1) * latency_us * 1e-6


def allreduce_over_link_s(num_bytes: float, ranks: int, link: LinkSpec) -> float:
    return ring_allreduce_s(num_bytes, ranks, link.bandwidth_GBps, link.latency_us)


def p2p_s(num_bytes: float, link: LinkSpec) -> float:
    return link.latency_us * 1e-6 + num_bytes / (link.bandwidth_GBps * 1e9)
