"""The error bar of a prediction: how far off to expect the predicted iteration time, and why.

Every term of a prediction has a relative error measured on published or local runs
(``experiments/fidelity/error_bars.py`` prints the table and checks the bars against runs):

- **compute on a GPU class** (layer passes, with their tensor-parallel collectives and the ZeRO traffic
  folded into them): the mean |error| of the datasheet model against measured runs of that class in
  that precision regime (``DATASHEET_TIME_ERROR``; with several sources, the mean of the sources' mean
  |error|, each source counting once); a class or regime with no measured run gets the largest of those
  (``UNVALIDATED_TIME_ERROR``: held-out runs on classes with none, H100 and H200, were 15-83% off, more
  than the validated classes' median); a device the calibration profile measured gets
  ``CALIBRATED_TIME_ERROR``.
- **network** (pipeline sends and data-parallel synchronisation between nodes): ``network_error`` of the
  link's bandwidth: within the validated range (>= 10 GB/s: Megatron-LM's and Sailor's clusters) 10%,
  growing log-linearly to 15.2% at 0.115 GB/s (~1 Gbit/s): the mean |error| of Sailor's MIT runs, consumer
  GPUs whose pipelines and data-parallel rings cross 1 Gbit/s Ethernet (8 runs, ``sailor_mit.py``; 101%
  before the simulator counted Megatron-LM's scatter/gather of pipeline sends, ``engine_terms``).

The simulator measures how much each term moves the iteration: it reruns the schedule with one term
stretched by its error (``Simulator``), so a term hidden behind others (a send 1F1B overlaps, a class off
the critical path) contributes little. ``combine`` adds the terms' contributions in quadrature (they are
independent sources) and names the largest.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

#: mean |relative error| of the datasheet time model per (GPU family, precision regime), from runs nothing
#: was fitted to unless said (experiments/fidelity/error_bars.py; experiments/RESULTS.md "Error bars")
DATASHEET_TIME_ERROR: dict[tuple[str, str], float] = {
    # Megatron-LM on A100: Narayanan et al. 2021 Table 1 + Korthikanti et al. 2022 (14 rows, 4.9%) and the
    # README of 2020 on DGX-A100 (8 runs, 4.0%)
    ("A100", "16-bit"): 0.044,
    # Sailor's A100-40GB per-layer times, OPT-350M fp32 unfused attention (12 entries): 36.2%
    ("A100", "fp32"): 0.362,
    # Sailor's V100-16GB per-layer times, OPT-350M fp32 (11 entries): 3.5%
    ("V100", "fp32"): 0.035,
    # V100-32GB: ZeRO-Offload (Ren et al. 2021), PyTorch alone, 1.4B (1 row): 61.6%, 2.6x too fast; Megatron-LM's
    # README of 2020 on one DGX-2 (4 runs): 4.8%
    ("V100", "16-bit"): 0.332,
    # Sailor's GH200 runs held out of the backward fit (GPT-Neo-2.7B, fp32, 11 runs): 13.5%
    ("GH200", "fp32"): 0.135,
    # RoundPipe's published 1-8 x RTX-4090 throughput (36 points), at the fp16-accumulate rate the runs used: 18.1%
    ("RTX-4090", "16-bit"): 0.181,
}
#: a GPU class (or precision) with no measured run: the largest of the validated entries above
UNVALIDATED_TIME_ERROR = max(DATASHEET_TIME_ERROR.values())
#: a device whose layer times the calibration profile measured: this machine's CPU runs (19 plans, 10.6%)
#: and Sailor's GH200 runs with Sailor's layer times as the profile (26 runs, 6.7%): their mean
CALIBRATED_TIME_ERROR = (0.106 + 0.067) / 2
#: network links: the error at and above the validated bandwidth, and at ~1 Gbit/s (Sailor's MIT runs)
NETWORK_ERROR_VALIDATED, NETWORK_VALIDATED_GBps = 0.10, 10.0
NETWORK_ERROR_SLOW, NETWORK_SLOW_GBps = 0.152, 0.115
#: a term whose contribution is below this is not named in ``error_terms``
NAMED_TERM_MIN = 0.01


def family(device_name: str) -> str:
    """The GPU family a catalog name belongs to (``A100-80GB`` -> ``A100``; ``RTX-4090`` stays, and so does a
    card of the user's own named after it, such as ``RTX-4090-fp16acc``)."""
    for prefix in ("A100", "A800", "V100", "H100", "H200", "GH200", "RTX-4090"):
        if device_name.startswith(prefix):
            return "A100" if prefix == "A800" else prefix
    return device_name


def regime(precision: str) -> str:
    return "fp32" if precision == "fp32" else "16-bit"


@functools.lru_cache(maxsize=256)
def compute_error(device_name: str, precision: str, calibrated: bool) -> tuple[float, str]:
    """(relative error, label) of the compute term of one device class."""
    if calibrated:
        return CALIBRATED_TIME_ERROR, f"compute on {device_name} (profiled)"
    key = (family(device_name), regime(precision))
    if key in DATASHEET_TIME_ERROR:
        return DATASHEET_TIME_ERROR[key], f"compute on {device_name} ({key[1]}, datasheet)"
    return UNVALIDATED_TIME_ERROR, f"compute on {device_name} ({key[1]}, datasheet, no measured run)"


@functools.lru_cache(maxsize=64)
def network_error(bandwidth_GBps: float) -> tuple[float, str]:
    """(relative error, label) of traffic over a network link of this bandwidth."""
    if bandwidth_GBps >= NETWORK_VALIDATED_GBps:
        sigma = NETWORK_ERROR_VALIDATED
    elif bandwidth_GBps <= NETWORK_SLOW_GBps:
        sigma = NETWORK_ERROR_SLOW
    else:
        t = math.log(NETWORK_VALIDATED_GBps / bandwidth_GBps) / math.log(NETWORK_VALIDATED_GBps / NETWORK_SLOW_GBps)
        sigma = NETWORK_ERROR_VALIDATED + t * (NETWORK_ERROR_SLOW - NETWORK_ERROR_VALIDATED)
    inside = "" if bandwidth_GBps >= NETWORK_VALIDATED_GBps else ", below the validated range"
    return sigma, f"network at {bandwidth_GBps:g} GB/s{inside}"


def combine(contributions: Iterable[tuple[str, float]], top: int = 3) -> tuple[float, tuple[str, ...]]:
    """``(expected_error, error_terms)`` of terms' relative contributions to the iteration time: their
    quadrature sum, and the labels of the largest ``top`` (largest first)."""
    merged: dict[str, float] = {}
    for label, c in contributions:
        merged[label] = merged.get(label, 0.0) + abs(c)
    total = math.sqrt(sum(c * c for c in merged.values()))
    named = sorted((c, label) for label, c in merged.items() if c >= NAMED_TERM_MIN)
    return total, tuple(label for _, label in reversed(named[-top:]))


def describe(expected_error: float, error_terms: tuple[str, ...]) -> str:
    """``±12% (mostly network at 0.125 GB/s, below the validated range)``: the bar as tables print it."""
    if not expected_error:
        return "not estimated"
    return f"±{expected_error:.0%}" + (f" (mostly {error_terms[0]})" if error_terms else "")
