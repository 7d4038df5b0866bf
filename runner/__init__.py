"""Real training of a parallel plan on torch.distributed: short profiled runs and full training.

Rank mapping: rank ``r`` runs device ``config.devices[r]``, the config's device order (pipelines in
order, their stages in order, each stage's devices in order). On CPU every rank is one process
with one thread on the gloo backend; on CUDA the backend is NCCL and local rank ``k`` uses
``cuda:k`` (so a node's ranks must be that node's devices, in config order).

Parallelism: pipeline stages with uneven layer counts (``torch.distributed.pipelining``: 1F1B, GPipe,
interleaved 1F1B); pipelines are data-parallel replicas whose gradients are all-reduced among
exactly the ranks holding each weight, weighted by each replica's share of the global batch; a
stage with several devices is tensor-parallel (DTensor ``parallelize_module``, Megatron-style
column/row split; runs on gloo and NCCL). Stages of one pipeline at different tensor-parallel
degrees run on ``runner.mixed`` (hand-offs of ``autotune.specs.handoff``), replicas at different degrees
average their gradients part by part (``runner.reshard``). Not supported, with a clear error:
interleaving stages of different degrees, and a tensor-parallel degree that does not divide
``num_kv_heads``.

Emulated slowdown: a ``cpu`` node with ``slowdown: f`` in the cluster file makes its ranks sleep
``(f - 1)`` times their measured forward/backward compute after each one, to test heterogeneous
plans on one machine. It is emulation, off unless the cluster sets it.

Memory: CUDA reports the device's view in ``peak_memory_GiB`` (used memory after the timed steps, as
nvidia-smi shows it) and ``torch.cuda.max_memory_allocated`` in ``allocated_memory_GiB``; CPU reports
the growth of the process's peak RSS during the run in both.

Test-only fault injection: ``AUTOTUNE_FAULT=raise:rank1`` / ``hang:rank1`` (``runner.worker``).

Entry points: ``profiled_run`` and ``RealEvaluator`` (``runner.launch``), ``train`` (``runner.train``).
"""

from runner.launch import RealEvaluator, profiled_run

__all__ = ["RealEvaluator", "profiled_run"]
