"""The job a launcher hands its ranks (a JSON file), and the checks done before anything is launched.

A job carries the cluster, model and config as plain data (so a ``ClusterSpec`` built in memory can
travel to worker processes), the mode (``profile`` or ``train``) and that mode's options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from autotune.errors import SpecError
from autotune.loading import cluster_from_dict, model_from_dict
from autotune.specs import ClusterSpec, ModelSpec, ParallelConfig
from runner.layout import Layout, build_layout, check_supported


def cluster_to_dict(cluster: ClusterSpec) -> dict[str, Any]:
    """A cluster in the cluster-file format (GPUs inline), readable by ``cluster_from_dict``."""
    nodes = []
    for n in cluster.nodes:
        node: dict[str, Any] = {
            "name": n.name,
            "gpu": {
                "name": n.device.name,
                "peak_tflops": n.device.peak_tflops,
                "memory_GiB": n.device.memory_GiB,
                "memory_bandwidth_GBps": n.device.memory_bandwidth_GBps,
                "source": n.device.source,
                "pcie_gen": n.device.pcie_gen,
                "pcie_lanes": n.device.pcie_lanes,
                "peak_tflops_tf32": n.device.peak_tflops_tf32,
                "peak_tflops_fp32": n.device.peak_tflops_fp32,
            },
            "count": n.count,
            "intra_node": {"bandwidth_GBps": n.intra_node.bandwidth_GBps, "latency_us": n.intra_node.latency_us},
            "network": {"bandwidth_GBps": n.network.bandwidth_GBps, "latency_us": n.network.latency_us},
        }
        if n.slowdown != 1.0:
            node["slowdown"] = n.slowdown
        if n.host is not None:
            node["host"] = {
                "memory_GiB": n.host.memory_GiB,
                "bandwidth_GBps": n.host.bandwidth_GBps,
                "link": {"bandwidth_GBps": n.host.link.bandwidth_GBps, "latency_us": n.host.link.latency_us},
            }
        nodes.append(node)
    return {"name": cluster.name, "nodes": nodes}


def make_job(mode: str, cluster: ClusterSpec, model: ModelSpec, config: ParallelConfig, **options: Any) -> dict:
    return {
        "mode": mode,
        "cluster": cluster_to_dict(cluster),
        "model": asdict(model),
        "config": config.to_dict(),
        **options,
    }


def read_job(job: dict) -> tuple[ClusterSpec, ModelSpec, ParallelConfig]:
    cluster = cluster_from_dict(job["cluster"], "job cluster")
    model = model_from_dict(job["model"], "job model")
    config = ParallelConfig.from_dict(job["config"], "job config")
    return cluster, model, config


def uses_cuda(cluster: ClusterSpec, config: ParallelConfig, cuda_available: bool) -> bool:
    """True for a GPU plan (NCCL), False for a CPU plan (gloo); SpecError if this machine cannot run it."""
    kinds = {cluster.device(d).name for d in config.devices}
    gpus = sorted(k for k in kinds if k != "cpu")
    if gpus and "cpu" in kinds:
        raise SpecError(
            "runner",
            "devices",
            f"plan mixes cpu and GPU devices ({', '.join(gpus)}); the runner runs one kind per plan",
        )
    if gpus and not cuda_available:
        raise SpecError(
            "runner",
            "cluster",
            f"cluster {cluster.name!r} has GPU devices ({', '.join(gpus)}) but this "
            "machine has no CUDA; use a cpu cluster (cpu-2, cpu-4, cpu-hetero)",
        )
    return bool(gpus)


def check_model_supported(model: ModelSpec, config: ParallelConfig) -> None:
    """Refuse, in one line, a model the runner's decoder (runner/model.py) would build differently from
    its spec: shared experts, and a tied head on another rank than the embedding."""
    if model.shared_expert_ffn_hidden_size:
        raise SpecError(
            "runner",
            "model.shared_expert_ffn_hidden_size",
            "the runner's MoE blocks have no shared experts yet; search, simulate and export take this model, "
            "`autotune train` does not",
        )
    if model.tied_embeddings and (config.virtual_stages > 1 or any(len(p.stages) > 1 for p in config.pipelines)):
        raise SpecError(
            "runner",
            "model.tied_embeddings",
            "a tied LM head on another stage than the embedding is not run by the runner (it keeps one "
            "matrix); use a plan of one-stage pipelines",
        )


def preflight(
    cluster: ClusterSpec,
    model: ModelSpec,
    config: ParallelConfig,
    schedule_check: bool = True,
    assume_cuda: bool = False,
) -> Layout:
    """Everything that can be checked before launching: validity, runner support, CUDA presence. A roundpipe
    plan gets ``runner.roundpipe_run.preflight`` (one process for its pool, CUDA and the library)."""
    if config.is_roundpipe:
        from runner.roundpipe_run import preflight as roundpipe_preflight

        return roundpipe_preflight(cluster, model, config)  # type: ignore[return-value]
    check_model_supported(model, config)
    layout = build_layout(cluster, model, config)
    for p, pipe in enumerate(config.pipelines):
        for s, stage in enumerate(pipe.stages):
            if stage.sequence_parallel and stage.tp > 1 and model.seq_len % stage.tp:
                raise SpecError(
                    "runner",
                    f"pipelines[{p}].stages[{s}].sequence_parallel",
                    f"needs seq_len={model.seq_len} divisible by the tensor-parallel degree {stage.tp}",
                )
    for plan in layout.ranks:
        if plan.tp_degree > 1:
            check_supported(plan, model)
    if config.schedule == "1f1b" and not layout.mixed:  # runner.mixed runs its own orders
        for p, pipe in enumerate(config.pipelines):
            # torch.distributed.pipelining.Schedule1F1B refuses fewer micro-batches than stages
            if pipe.num_microbatches < len(pipe.stages):
                raise SpecError(
                    "runner",
                    f"pipelines[{p}].num_microbatches",
                    f"1f1b in torch.distributed.pipelining needs at least as many micro-batches as "
                    f"stages: {pipe.num_microbatches} < {len(pipe.stages)}",
                )
    if config.schedule == "interleaved-1f1b":
        for p, pipe in enumerate(config.pipelines):
            # torch.distributed.pipelining.ScheduleInterleaved1F1B: micro-batches run in rounds of
            # (pipeline size) and must fill whole rounds
            rounds = max(1, pipe.num_microbatches // len(pipe.stages))
            if pipe.num_microbatches % rounds:
                raise SpecError(
                    "runner",
                    f"pipelines[{p}].num_microbatches",
                    f"interleaved-1f1b in torch.distributed.pipelining needs num_microbatches to be a "
                    f"multiple of num_microbatches // stages = {rounds}, got {pipe.num_microbatches}",
                )
    if uses_cuda(cluster, config, assume_cuda or _cuda_available()) and model.precision == "fp16":
        raise SpecError(
            "runner",
            "precision",
            "fp16 training needs loss scaling, which the runner does not implement; use bf16 (or fp32) on CUDA",
        )
    return layout


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def plan_limits(cluster: ClusterSpec, model: ModelSpec) -> Callable[[ParallelConfig], str | None] | None:
    """The runner's limits as a search keeps to them (``autotune search`` on the simulator backend): for a
    plan, why ``autotune train`` would refuse it (its pre-flight with CUDA, the GPUs and the RoundPipe
    library assumed present), None when it runs it. None for a model the runner does not train at all
    (shared experts, fp16): every plan would be refused, so the search is not limited."""
    if model.shared_expert_ffn_hidden_size or model.precision == "fp16":
        return None

    def refusal(config: ParallelConfig) -> str | None:
        e = preflight_refusal(cluster, model, config)
        if e is None:
            return None
        return (
            f"the runner does not run it ({e.field}): {e.rule}" if e.field else f"the runner does not run it: {e.rule}"
        )

    return refusal


def preflight_refusal(cluster: ClusterSpec, model: ModelSpec, config: ParallelConfig) -> SpecError | None:
    """What ``autotune train``'s pre-flight says of ``config`` on a machine with CUDA, the cluster's GPUs and
    the RoundPipe library (a RoundPipe plan through its own pre-flight): the refusal, or None."""
    try:
        if config.is_roundpipe:
            from runner.roundpipe_run import preflight as roundpipe_preflight

            gpus = max(n.count for n in cluster.nodes)
            roundpipe_preflight(cluster, model, config, cuda_available=True, gpu_count=gpus, library=True)
        else:
            preflight(cluster, model, config, assume_cuda=True)
    except SpecError as e:
        return e
    return None
