"""How fast a device runs a matmul or a memory-bound kernel: the sustained fraction of its peak.

Without a calibration profile a matmul of equivalent square size ``n`` (cube root of ``M * N * K``)
sustains

    peak * PEAK_FRACTION * n^2 / (n^2 + HALF_SIZE^2)

with ``peak`` the datasheet dense rate of the model's precision (``DeviceSpec.matmul_peak_tflops``: the
16-bit tensor rate for bf16/fp16, the TF32 rate for fp32),
a saturating curve: small matmuls cannot fill the GPU's streaming multiprocessors and are bound by
memory traffic and launch overhead, large ones approach ``PEAK_FRACTION`` of the datasheet peak.
``PEAK_FRACTION = 0.8`` is an assumption in the range public 16-bit cuBLAS benchmarks report for large
GEMMs (roughly 0.75 on H100 SXM to 0.9 on A100); ``HALF_SIZE = 512`` puts a 512-cube matmul at half of
that and a 2048-cube one at 94% of it. Both are defaults only: ``autotune profile`` measures the curve
per device type and a ``CalibrationProfile`` replaces it (interpolated in log n, clamped at the ends).

Without a profile a matmul also takes at least the time to move its operands and result once through
memory (a roofline; ``DeviceRates.matmul_s``). Memory-bound kernels (layer norms, activations,
softmax, dropout, residual adds, the optimizer step) move their bytes at ``MEMORY_FRACTION`` of the
datasheet memory bandwidth (or of the profiled one).
"""

from __future__ import annotations

from autotune.profile import DeviceProfile
from autotune.simulator.flops import Matmul
from autotune.specs import DeviceSpec

PEAK_FRACTION = 0.8  # sustained fraction of datasheet dense 16-bit peak for large matmuls (assumption)
HALF_SIZE = 512.0  # equivalent square size at which a matmul reaches half of PEAK_FRACTION
MEMORY_FRACTION = 0.8  # sustained fraction of datasheet memory bandwidth for streaming kernels (assumption)


def effective_precision(device: DeviceSpec, precision: str) -> str:
    """The precision a device really computes a model of ``precision`` in: the CPU runner computes in
    fp32 whatever the model says (its catalog peak is the fp32 rate), GPUs in the model's precision."""
    return "fp32" if device.name == "cpu" else precision


class DeviceRates:
    """Sustained speeds of one device type, from the default curve or a profile, for a model trained in
    ``precision`` (the matmul peak is ``DeviceSpec.matmul_peak_tflops(precision)``; ``elem_bytes`` is the
    size of one activation element as this device computes it)."""

    __slots__ = ("device", "profile", "slowdown", "memory_bandwidth_GBps", "precision", "peak_tflops", "elem_bytes")

    def __init__(
        self, device: DeviceSpec, profile: DeviceProfile | None = None, slowdown: float = 1.0, precision: str = "bf16"
    ) -> None:
        self.device = device
        self.profile = profile
        self.slowdown = slowdown
        self.precision = effective_precision(device, precision)
        self.peak_tflops = device.matmul_peak_tflops(self.precision)
        self.elem_bytes = 4 if self.precision == "fp32" else 2
        if profile is not None and profile.memory_bandwidth_GBps is not None:
            self.memory_bandwidth_GBps = profile.memory_bandwidth_GBps  # measured: already sustained
        else:
            self.memory_bandwidth_GBps = device.memory_bandwidth_GBps * MEMORY_FRACTION

    def matmul_tflops(self, size: float) -> float:
        """Sustained TFLOP/s for a matmul of equivalent square size ``size``."""
        if self.profile is not None and self.profile.matmul:
            return self.profile.matmul_tflops(size) / self.slowdown
        n2 = size * size
        return self.peak_tflops * PEAK_FRACTION * n2 / (n2 + HALF_SIZE * HALF_SIZE) / self.slowdown

    def matmul_s(self, mm: Matmul) -> float:
        """Seconds of ``mm``: its FLOPs at the sustained rate for its size, but no less than moving its
        operands and result once through memory (a roofline: a batched attention matmul with a 64-wide
        inner dimension writes an ``s x s`` result per head and is bound by that traffic). A profile's
        measured curve already includes the memory effects at its shapes, so it is used alone (unless the
        profile says its curve is the datasheet's: ``DeviceProfile.matmul_roofline``)."""
        compute = mm.flops / (self.matmul_tflops(mm.size) * 1e12)
        if self.profile is not None and self.profile.matmul and not self.profile.matmul_roofline:
            return compute
        return max(compute, self.memory_s(self.elem_bytes * mm.elements))

    def memory_s(self, num_bytes: float) -> float:
        return num_bytes * self.slowdown / (self.memory_bandwidth_GBps * 1e9)
