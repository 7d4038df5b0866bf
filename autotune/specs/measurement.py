"""What one evaluation of a plan returns: a ``Measurement`` (predicted or measured) and its timeline."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    device: str
    op: str  # e.g. "F3" (forward of micro-batch 3), "B3", "allreduce", "optimizer", "send"
    start_s: float
    end_s: float


MEASUREMENT_STATUSES = ("ok", "oom", "failed", "timeout", "invalid")


@dataclass(frozen=True, slots=True)
class Measurement:
    """What one evaluation of a plan returns: the simulator's prediction or a profiled run's reading."""

    tokens_per_s: float
    iteration_time_s: float
    oom: bool
    peak_memory_GiB: Mapping[str, float] = field(default_factory=dict)
    mfu: float = 0.0
    bubble_fraction: float = 0.0
    stage_busy_s: tuple[float, ...] = ()  # per stage of the slowest pipeline: forward + backward busy time
    timeline: tuple[TimelineEvent, ...] = ()
    status: str = "ok"
    error: str = ""
    host_memory_GiB: Mapping[str, float] = field(default_factory=dict)  # node -> GiB, when a plan offloads
    #: SPES plans (sync_every_steps > 1): seconds of one synchronisation round; iteration_time_s includes
    #: it amortised over sync_every_steps. 0 for every other plan.
    sync_time_s: float = 0.0
    #: device -> GiB of tensors at the peak (what ``torch.cuda.max_memory_allocated`` reports); absent where
    #: not known. ``peak_memory_GiB`` is the device's view (nvidia-smi: plus CUDA context, library buffers
    #: and the allocator's pool).
    allocated_memory_GiB: Mapping[str, float] = field(default_factory=dict)
    #: the simulator's prediction only: the expected relative error of ``iteration_time_s`` (e.g. 0.12) and
    #: the terms that dominate it (``autotune.simulator.error_bar``); 0 and () for a measured run
    expected_error: float = 0.0
    error_terms: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok" and not self.oom

    def score(self) -> float:
        """Throughput that counts for search: 0 for any plan that does not run."""
        return self.tokens_per_s if self.ok else 0.0

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens_per_s": self.tokens_per_s,
            "iteration_time_s": self.iteration_time_s,
            "oom": self.oom,
            "peak_memory_GiB": dict(self.peak_memory_GiB),
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "stage_busy_s": list(self.stage_busy_s),
            "status": self.status,
            "error": self.error,
        }
        if self.host_memory_GiB:
            out["host_memory_GiB"] = dict(self.host_memory_GiB)
        if self.sync_time_s:
            out["sync_time_s"] = self.sync_time_s
        if self.allocated_memory_GiB:
            out["allocated_memory_GiB"] = dict(self.allocated_memory_GiB)
        if self.expected_error:
            out["expected_error"] = self.expected_error
            out["error_terms"] = list(self.error_terms)
        if timeline:
            out["timeline"] = [[e.device, e.op, e.start_s, e.end_s] for e in self.timeline]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
        return cls(
            tokens_per_s=float(data.get("tokens_per_s", 0.0)),
            iteration_time_s=float(data.get("iteration_time_s", 0.0)),
            oom=bool(data.get("oom", False)),
            peak_memory_GiB={str(k): float(v) for k, v in dict(data.get("peak_memory_GiB", {})).items()},
            mfu=float(data.get("mfu", 0.0)),
            bubble_fraction=float(data.get("bubble_fraction", 0.0)),
            stage_busy_s=tuple(float(x) for x in data.get("stage_busy_s", ())),
            timeline=tuple(
                TimelineEvent(str(d), str(o), float(a), float(b)) for d, o, a, b in data.get("timeline", ())
            ),
            status=str(data.get("status", "ok")),
            error=str(data.get("error", "")),
            host_memory_GiB={str(k): float(v) for k, v in dict(data.get("host_memory_GiB", {})).items()},
            sync_time_s=float(data.get("sync_time_s", 0.0)),
            allocated_memory_GiB={str(k): float(v) for k, v in dict(data.get("allocated_memory_GiB", {})).items()},
            expected_error=float(data.get("expected_error", 0.0)),
            error_terms=tuple(str(t) for t in data.get("error_terms", ())),
        )

    @classmethod
    def failure(cls, status: str, error: str, oom: bool = False) -> Measurement:
        return cls(tokens_per_s=0.0, iteration_time_s=0.0, oom=oom, status=status, error=error)
