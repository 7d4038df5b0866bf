"""One rank's training engine: build this rank's chunks, wrap them as pipeline stages, run a schedule,
average gradients across replicas, step AdamW. Reads like torchtitan's train loop, in this order:

1. ``RankModel``: this rank's chunks (``runner.model.StageChunk``), with global parameter names.
2. Process groups, created by every rank in one fixed order: one point-to-point group per pipeline,
   one gradient group per set of ranks that hold the same weights (``Layout.grad_groups``).
3. ``TimedStage`` (a ``PipelineStage`` that clocks forward/backward and emulates ``slowdown``) and
   the schedule the config names (``Schedule1F1B``, ``ScheduleGPipe``, ``ScheduleInterleaved1F1B``).
4. ``step``: schedule -> weighted gradient all-reduce per holder group -> AdamW -> global loss.

A plan with a stage of several data-parallel ranks (Zorse), or with stages of different tensor-parallel
degrees in one pipeline, runs every pipeline on ``runner.mixed`` in place of step 3 (its own per-rank
orders and hand-offs; each micro-batch's loss weighted by its part of the global batch, so the holders'
all-reduce is a plain sum).

Gradient weighting: each schedule averages its micro-batch losses (``scale_grads``), so a pipeline's
gradient is that of the mean loss over its own ``B_p`` sequences. The global loss is the mean over
all ``B`` sequences, whose gradient is ``sum_p (B_p / B) grad_p``: every rank multiplies its
gradients by ``B_p / B`` and the holders of each weight sum them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from autotune.errors import SpecError
from autotune.simulator.engine_terms import vocab_split
from autotune.specs import ModelSpec
from runner.data import TokenSource
from runner.fsdp import fsdp_misfit, loss_scale
from runner.layout import EMBED_KEY, HEAD_KEY, Layout, check_supported
from runner.model import StageChunk, lm_loss, vocab_parallel_loss
from runner.optim import TrainSettings, local_tensor, make_optimizer, set_lr

log = logging.getLogger(__name__)


# AdamW settings, the same on every rank and in the single-process reference (GPT-3 paper, table 2.1
# style betas; lr sized for the tiny models this runs on CPU).
class RankModel(nn.Module):
    """All weights of one rank under their global names: ``embed``, ``blocks.<i>``, ``norm``, ``head``.

    The chunks share these modules; optimizer, gradient sync and checkpoints go through this module,
    so a weight's name does not depend on the plan.
    """

    def __init__(self, chunks: list[StageChunk]) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict()
        for chunk in chunks:
            if chunk.embed is not None:
                self.embed = chunk.embed
                if chunk.positions is not None:  # learned positions travel with the embedding
                    self.positions = chunk.positions
            for key, block in chunk.blocks.items():
                self.blocks[key] = block
            if chunk.head is not None:
                self.norm = chunk.norm
                self.head = chunk.head

    def params_of(self, key: str) -> list[nn.Parameter]:
        """Parameters of a holder key (``Layout``): ``embed``, ``layer<i>`` (an MoE block's: all but its
        experts), ``layer<i>.expert<e>`` or ``head`` (norm + head)."""
        if key == EMBED_KEY:
            mods = [self.embed] + ([self.positions] if hasattr(self, "positions") else [])
        elif key == HEAD_KEY:
            mods = [self.norm, self.head]
        else:
            layer, _, expert = key.removeprefix("layer").partition(".expert")
            block = self.blocks[layer]
            if expert:
                mods = [block.mlp.experts[expert]]
            elif hasattr(block.mlp, "experts"):
                return [
                    p
                    for n, p in sorted(block.named_parameters(), key=lambda kv: kv[0])
                    if not n.startswith("mlp.experts.")
                ]
            else:
                mods = [block]
        return [p for m in mods for _, p in sorted(m.named_parameters(), key=lambda kv: kv[0])]


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that adds up its forward and backward compute time.

    ``slowdown`` > 1 emulates a slower device (CPU testing only, off by default): after each forward
    or backward the rank sleeps ``(slowdown - 1)`` times the compute time it just measured.
    """

    def __init__(
        self,
        *args,
        slowdown: float = 1.0,
        cuda: bool = False,
        reshard_each_backward: bool = True,
        sync_each_backward: bool = True,
        loss_scale: float | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        # FSDP2 units, ``backward_maybe_with_nosync``: free the gathered weights (zero 3) and reduce-scatter the
        # gradient (zero 2 / 3) after every backward, or after the step's last one; ``loss_scale`` multiplies a
        # last stage's micro-batch loss before its backward (``runner.fsdp.loss_scale``)
        self.reshard_each_backward = reshard_each_backward
        self.sync_each_backward = sync_each_backward
        self.loss_scale = loss_scale
        self.slowdown = slowdown
        self.cuda = cuda
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.emulated_s = 0.0  # of forward_s + backward_s, the sleeps that emulate ``slowdown``
        self.recorder: EventRecorder | None = None

    def _clock(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _stretch(self, elapsed: float) -> float:
        if self.slowdown > 1.0:
            extra = (self.slowdown - 1.0) * elapsed
            time.sleep(extra)
            self.emulated_s += extra
            return elapsed + extra
        return elapsed

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        t0 = self._clock()
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        busy = self._stretch(self._clock() - t0)
        self.forward_s += busy
        if self.recorder:
            self.recorder.add(f"F{fwd_chunk_id}" + self._chunk_suffix(), t0, t0 + busy)
        return out

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        t0 = self._clock()
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        busy = self._stretch(self._clock() - t0)
        self.backward_s += busy
        if self.recorder:
            self.recorder.add(f"B{bwd_chunk_id}" + self._chunk_suffix(), t0, t0 + busy)
        return out

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        """An FSDP2 chunk (``runner.fsdp``) reduce-scatters every micro-batch's gradient after its backward, as
        ZeRO-2/3 do (torch's default accumulates the whole gradient until the step's last backward), zero 1 the
        accumulated gradient after the step's last; zero 3 frees the gathered weights after each backward, zero
        1 / 2 after the step's last."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.pipelining._backward import stage_backward

        if not isinstance(self.submod, FSDPModule) or backward_type != "full":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_requires_gradient_sync(self.sync_each_backward or last_backward)
        self.submod.set_reshard_after_backward(self.reshard_each_backward or last_backward)
        self.submod.set_is_last_backward(True)  # each backward's reductions complete before the next micro-batch
        kw = bwd_kwargs
        out = kw["stage_output"]
        if self.loss_scale is not None and self.is_last:  # the loss: its share of the global batch's gradient
            out = out * self.loss_scale
        return stage_backward(out, kw["output_grads"], kw["input_values"]), None

    def _chunk_suffix(self) -> str:
        return f"@{self.stage_index}" if self.recorder and self.recorder.tag_chunks else ""


class EventRecorder:
    """Collects one rank's timeline events (op, start, end) relative to a reference time."""

    def __init__(self, t_ref: float, tag_chunks: bool = False) -> None:
        self.t_ref = t_ref
        self.tag_chunks = tag_chunks  # interleaved: "F3@2" is micro-batch 3 on virtual stage 2
        self.events: list[tuple[str, float, float]] = []

    def add(self, op: str, start: float, end: float) -> None:
        self.events.append((op, start - self.t_ref, end - self.t_ref))


@dataclass
class StepResult:
    loss: float
    stop: bool
    time_s: float
    grad_norm: float | None = None  # the global gradient norm before clipping (with --clip-grad-norm)


def apply_tensor_parallel(
    chunks: list[StageChunk],
    mesh,
    device: torch.device,
    vocab_size: int,
    sequence_parallel: bool = False,
) -> None:
    """Megatron-style TP on every block (``parallelize_module``): Q/K/V and the MLP's up/gate projections
    column-parallel, the attention output and MLP down projections row-parallel. Each TP rank keeps
    whole heads (``Attention`` infers the local head count). Norms stay replicated: their inputs and
    gradients are identical on every TP rank.

    Where the degree divides the vocabulary (``autotune.simulator.engine_terms.vocab_split``, what the
    simulator counts) the embedding and the LM head are vocabulary-parallel, Megatron-LM's and torchtitan's
    layout: the embedding row-parallel (``RowwiseParallel``: each rank looks up its rows, one all-reduce),
    the head column-parallel (``ColwiseParallel``: each rank computes its part of the logits) and the loss
    torch's ``loss_parallel`` cross entropy over those parts (``runner.model.lm_loss``); a tied head
    multiplies by the split embedding. Elsewhere both stay whole on every rank.

    ``sequence_parallel`` (Korthikanti et al. 2022, the torchtitan layout): between the blocks' matmuls
    the residual stream is split along the sequence across the TP ranks: the norms run on their rank's
    part (``SequenceParallel``), the attention and MLP inputs are all-gathered (``PrepareModuleInput``)
    and the row-parallel outputs reduce-scattered (``RowwiseParallel(output_layouts=Shard(1))``)
    instead of all-reduced. A chunk's output (what the next stage receives) is its rank's part of the
    sequence; the first chunk splits the embedding's output, the last gathers the sequence again before
    the final norm and head (``StageChunk.sequence_mesh``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    for chunk in chunks:
        for block in chunk.blocks.values():
            moe = hasattr(block.mlp, "set_tensor_parallel")  # an MoE block splits its experts itself
            plan = {
                "attn.q_proj": ColwiseParallel(),
                "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(),
            }
            if not moe:
                plan["mlp.up_proj"] = ColwiseParallel()
                if block.mlp.swiglu:
                    plan["mlp.gate_proj"] = ColwiseParallel()
            if sequence_parallel:
                gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                plan.update(
                    {
                        "attn_norm": SequenceParallel(),
                        "mlp_norm": SequenceParallel(),
                        "attn": gather,
                        "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                    }
                )
                if not moe:
                    plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                    plan["mlp.down_proj"] = RowwiseParallel(output_layouts=Shard(1))
            else:
                plan["attn.o_proj"] = RowwiseParallel()
                if not moe:
                    plan["mlp.down_proj"] = RowwiseParallel()
            parallelize_module(block, mesh, plan)
            if moe:
                block.mlp.set_tensor_parallel(mesh, sequence_parallel)
        if sequence_parallel:
            chunk.sequence_mesh = mesh
        if not vocab_split(vocab_size, mesh.size()):
            continue
        if chunk.embed is not None:
            parallelize_module(chunk.embed, mesh, RowwiseParallel(input_layouts=Replicate()))
        if isinstance(chunk.head, nn.Linear):
            parallelize_module(chunk.head, mesh, ColwiseParallel(output_layouts=Shard(-1)))
        if chunk.head is not None:
            chunk.vocab_mesh = mesh
    # DTensor leaves some gradients laid out otherwise than their weights: a vocabulary-parallel embedding's
    # whole on every rank, a sequence-parallel norm's a partial sum (each rank's part of the sequence)
    for chunk in chunks:
        for p in chunk.parameters():
            if isinstance(p, DTensor):
                p.register_post_accumulate_grad_hook(_grad_as_placed)


def _grad_as_placed(p: nn.Parameter) -> None:
    """A DTensor weight's gradient laid out as the weight (a replicated gradient of a sharded weight: this
    rank's part, no communication; a partial one of a replicated weight: all-reduced), so that every rank
    syncs, clips and steps what it holds."""
    if p.grad is not None and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)


class Engine:
    """Everything one rank needs to train its part of the plan."""

    def __init__(
        self,
        layout: Layout,
        model: ModelSpec,
        rank: int,
        device: torch.device,
        *,
        schedule: str,
        seed: int,
        tokens: TokenSource,
        settings: TrainSettings | None = None,
        init_from: str | None = None,
        fsdp: bool = True,
        compile_blocks: bool = False,
    ) -> None:
        """``fsdp``: run ZeRO on FSDP2 where it fits (``runner.fsdp``), else on ``runner.zero``;
        ``compile_blocks``: ``torch.compile`` each block (``runner.model.compile_blocks``)."""
        self.layout = layout
        self.plan = layout.ranks[rank]
        self.rank = rank
        self.model_spec = model
        self.device = device
        self.tokens = tokens
        check_supported(self.plan, model)

        # 1. this rank's chunks, deterministic weights per layer index
        self.chunks = [
            StageChunk(
                model,
                c.layers,
                first=c.first,
                last=c.last,
                seed=seed,
                recompute=self.plan.recompute,
                experts=self.plan.held_experts,
            ).to(device)
            for c in self.plan.chunks
        ]
        if init_from:  # a Hugging Face checkpoint: this rank reads its chunks' tensors (runner.hf_checkpoint)
            from runner.hf_checkpoint import load_weights

            load_weights(self.chunks, init_from)
        if device.type == "cuda" and model.precision == "bf16":
            for chunk in self.chunks:
                chunk.autocast_dtype = torch.bfloat16

        # 2. process groups: every rank creates every group, in the same order
        self.pp_group = None
        for ranks in layout.pipeline_groups() if not layout.mixed else ():  # runner.mixed sends on the world
            group = dist.new_group(list(ranks))
            if rank in ranks:
                self.pp_group = group
        tp_group = None
        for ranks in layout.tp_groups():
            group = dist.new_group(list(ranks))
            if rank in ranks:
                tp_group = group
        # ZeRO 1-3 where the replicas' collectives pair up: torch's FSDP2 over each stage's (dp, tp) mesh
        self.fsdp_mesh = self.expert_mesh = None
        if fsdp and layout.sharded and fsdp_misfit(layout) is None:
            from runner.fsdp import expert_mesh, stage_mesh

            self.fsdp_mesh = stage_mesh(layout, rank, device.type, tp_group)
            self.expert_mesh = expert_mesh(layout, rank, device.type)  # MoE: experts over their holders
        if tp_group is not None:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = self.fsdp_mesh["tp"] if self.fsdp_mesh is not None else DeviceMesh.from_group(tp_group, device.type)
            apply_tensor_parallel(
                self.chunks, mesh, device, model.vocab_size, sequence_parallel=self.plan.sequence_parallel
            )
        if compile_blocks:  # after tensor parallelism, before FSDP2 (torchtitan's order)
            from runner.model import compile_blocks as compile_

            compile_(self.chunks)
        self.module = RankModel(self.chunks)
        # MoE / SPES plans: expert parallelism, frozen experts and their own exchange (runner.moe)
        self.expert_sync = None
        if model.is_moe or self.plan_config_spes(layout):
            from runner.moe import setup_experts

            names = {p: n for n, p in self.module.named_parameters()}
            self.expert_sync = setup_experts(
                self.chunks, self.module.params_of, layout, rank, names, model.vocab_size, exchange=not self.fsdp
            )
        self.grad_groups: list[tuple[dist.ProcessGroup | None, list[nn.Parameter]]] = []
        self.settings = settings or TrainSettings()
        self.copies: dict[nn.Parameter, int] = {}  # gradient clipping (``_clip_gradients``)
        self._training_state(layout, rank, model)

        # 3. stages and schedule
        self._build_schedule(layout, model, device, schedule)

    @property
    def fsdp(self) -> bool:
        """Whether torch's FSDP2 shards this rank's training state (``runner.fsdp``)."""
        return self.fsdp_mesh is not None

    def _training_state(self, layout: Layout, rank: int, model: ModelSpec) -> None:
        """Optimizer, gradient synchronisation and clipping counts: FSDP2 for ZeRO 1-3 where the replicas'
        collectives pair up (``runner.fsdp``), ``runner.zero`` for every other sharded or offloaded plan, else
        all-reduce groups."""
        device = self.device
        self.zero = None
        if layout.sharded and rank == 0:  # which engine shards the state, and why not FSDP2
            why = fsdp_misfit(layout) or "a checkpoint runner.zero wrote"
            log.info("zero %d on %s", layout.zero, "torch's FSDP2" if self.fsdp else f"runner.zero (not FSDP2: {why})")
        if self.fsdp:  # torch's FSDP2 shards weights, gradients, optimizer state (runner.fsdp)
            from runner.fsdp import key_meshes, shard_chunks, tp_copies

            by_key = key_meshes(layout, rank, device.type)  # replicas of other layer splits: per weight key
            shard_chunks(self.chunks, self.fsdp_mesh, layout.zero, self.plan.offload, self.expert_mesh, by_key)
            self.optimizer = make_optimizer(list(self.module.parameters()), self.settings)
            self.copies = tp_copies(self.module.parameters(), self.plan.tp_degree)
        elif layout.sharded:  # ZeRO sharding / CPU offload: runner.zero keeps the optimizer and the gradients
            from runner.sharded_state import ShardedState

            self.zero = ShardedState(
                layout, rank, self.module, device, experts=self.expert_sync is not None, vocab_size=model.vocab_size
            )
            if self.zero.per_microbatch:  # its collectives pair up only if every expert runs every micro-batch
                from runner.moe import run_every_expert

                run_every_expert(self.chunks)
            self.optimizer = self.zero.optimizer
            for g in self.optimizer.param_groups:
                g["weight_decay"] = self.settings.weight_decay
        else:
            self.optimizer = make_optimizer([p for p in self.module.parameters() if p.requires_grad], self.settings)
            self._gradient_groups(layout, rank)
            # weights replicas shard with different tensor-parallel degrees (runner.reshard)
            self.reshard = None
            if self.expert_sync is None and layout.resharded():
                from runner.reshard import ReshardedGradients

                names = {p: n for n, p in self.module.named_parameters()}
                self.reshard = ReshardedGradients(layout, rank, self.module.params_of, names, model.vocab_size)
                self.copies.update(self.reshard.copies)

    def _gradient_groups(self, layout: Layout, rank: int) -> None:
        """The groups that all-reduce each weight's gradient (``grad_groups``; an MoE / SPES plan's are its
        exchange's) and how many ranks hold each tensor (``copies``: its share of the clipping norm; an MoE
        plan's weights are held alike by their trainers when they synchronise every step)."""

        def count(p: nn.Parameter, ranks: int) -> None:
            sharded = isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
            self.copies[p] = ranks * (1 if sharded else self.plan.tp_degree)

        if self.expert_sync is not None:
            for g in self.expert_sync.step_groups if layout.sync_every_steps == 1 else ():
                for p in g.params if rank in g.trainers else ():
                    if g.parted:  # a part's trainers: one rank per replica (a weight kept whole: every rank)
                        self.copies[p] = len(g.trainers)
                    else:
                        count(p, len(g.trainers))
            return
        for ranks, keys in layout.grad_groups().items():
            group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if rank in ranks:
                params = [p for key in sorted(keys) for p in self.module.params_of(key)]
                self.grad_groups.append((group, params))
                for p in params:  # ranks holding this very tensor: its share of the global norm
                    count(p, len(ranks))

    def _build_schedule(self, layout: Layout, model: ModelSpec, device: torch.device, schedule: str) -> None:
        """The rank's pipeline stages and the schedule the plan names (``runner.mixed`` for mixed stages)."""
        cuda = device.type == "cuda"
        self.mixed = None
        if layout.mixed:  # mixed or uneven stages: every pipeline runs runner.mixed's orders and hand-offs
            from runner.mixed import MixedPipeline

            if self.plan.layerwise:  # Zorse's layer-wise execution on the same hand-offs
                from runner.layerwise import LayerwisePipeline

                self.mixed = LayerwisePipeline(
                    layout,
                    self.plan,
                    self.chunks,
                    model,
                    device,
                    schedule,
                    offload=self.plan.offload,
                    zero=self.zero,
                )
            else:
                self.mixed = MixedPipeline(layout, self.plan, self.chunks, model, device, schedule)
            self.stages = [self.mixed.clock]
            return
        static = {}
        self.stages = []
        scale = loss_scale(layout) if self.fsdp else None  # zero 1 over other micro-batch counts (runner.fsdp)
        for chunk, c in zip(self.chunks, self.plan.chunks):
            if self.zero is not None or self.fsdp:  # no metadata-inference pass: it would run the units' hooks
                static = self._static_metadata(c)
            self.stages.append(
                TimedStage(
                    chunk,
                    c.stage_index,
                    c.num_stages,
                    device,
                    group=self.pp_group,
                    slowdown=self.plan.slowdown,
                    cuda=cuda,
                    reshard_each_backward=layout.zero >= 3,
                    sync_each_backward=layout.zero >= 2,
                    loss_scale=scale,
                    **static,
                )
            )
        n = self.plan.num_microbatches
        kw = {"loss_fn": partial(lm_loss, mesh=self.chunks[-1].vocab_mesh), "scale_grads": scale is None}
        try:
            if schedule == "interleaved-1f1b":
                self.schedule = ScheduleInterleaved1F1B(self.stages, n, **kw)
            elif schedule == "gpipe":
                self.schedule = ScheduleGPipe(self.stages[0], n, **kw)
            else:
                self.schedule = Schedule1F1B(self.stages[0], n, **kw)
        except ValueError as e:  # e.g. interleaved 1F1B's micro-batch rule
            raise SpecError("runner", "schedule", f"torch.distributed.pipelining rejects this plan: {e}") from None

    def _static_metadata(self, chunk) -> dict:
        """Example input / output tensors of a chunk (meta device: shapes and dtypes only)."""
        m = self.model_spec
        mbs = self.plan.batch_size // self.plan.num_microbatches
        hidden = torch.empty(mbs, m.seq_len, m.hidden_size, device="meta", requires_grad=True)
        inp = torch.empty(mbs, m.seq_len, dtype=torch.long, device="meta") if chunk.first else hidden
        out = torch.empty(mbs, m.seq_len, m.vocab_size, device="meta", requires_grad=True) if chunk.last else hidden
        meta = {"input_args": (inp,), "output_args": (out,)}
        if not chunk.last:  # the gradient the next stage sends back
            meta["output_grads"] = (hidden,)
        if not chunk.first:  # the gradient sent to the previous stage
            meta["input_grads"] = (hidden,)
        return meta

    # ---------------------------------------------------------------------------------------------
    def busy(self) -> tuple[float, float]:
        return sum(s.forward_s for s in self.stages), sum(s.backward_s for s in self.stages)

    def emulated(self) -> float:
        """Seconds of ``busy()`` that are ``slowdown``'s sleeps (0 without one)."""
        return sum(s.emulated_s for s in self.stages)

    @staticmethod
    def plan_config_spes(layout: Layout) -> bool:
        return layout.sync_every_steps > 1 or any(r.trains_experts is not None for r in layout.ranks)

    def _sync_gradients(self) -> None:
        if self.expert_sync is not None:
            self.expert_sync.sync_gradients()
            return
        w = 1.0 if self.mixed is not None else self.plan.grad_weight  # runner.mixed weighs each micro-batch
        if getattr(self, "reshard", None) is not None:
            self.reshard.sync(w)
        for group, params in self.grad_groups:
            for p in params:
                if p.grad is None:  # a weight the schedule did not touch still takes part in the sum
                    p.grad = torch.zeros_like(p)
            grads = [local_tensor(p.grad) for p in params]
            if group is None:  # the only holder (a single pipeline): w is 1
                if w != 1.0:
                    for g in grads:
                        g.mul_(w)
                continue
            flat = torch.cat([g.reshape(-1) for g in grads]).mul_(w)
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in grads:  # g is p.grad's own storage (a DTensor's local shard under TP)
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n

    def record_next_step(self) -> EventRecorder:
        """Record the next step's forward/backward/all-reduce/optimizer events (times from its start)."""
        chunks = len(self.stages) > 1 or (self.mixed is not None and len(self.mixed.chunks) > 1)
        recorder = EventRecorder(time.perf_counter(), tag_chunks=chunks)
        for stage in self.stages:
            stage.recorder = recorder
        self._recorder = recorder
        return recorder

    def _clip_gradients(self, max_norm: float) -> float:
        """Scale every gradient so their global L2 norm (over all ranks, each tensor counted once: a copy
        held by ``n`` ranks adds ``1/n`` of its square) is at most ``max_norm``; the norm before."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for p, copies in self.copies.items():
            if p.grad is not None:
                g = local_tensor(p.grad)
                grads.append(g)
                sq += g.double().pow(2).sum().to(sq.device) / copies  # FSDP2 offload: gradients in host memory
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        scale = max_norm / (norm + 1e-6)
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)
        return norm

    def step(self, step_index: int, stop_requested: bool = False, lr: float | None = None) -> StepResult:
        recorder, self._recorder = getattr(self, "_recorder", None), None
        if recorder:
            recorder.t_ref = time.perf_counter()
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if self.zero is not None:
            self.module.zero_grad(set_to_none=True)
            self.zero.begin_step()
        x, y = self.tokens.pipeline_batch(step_index, self.plan.batch_offset, self.plan.batch_size)
        x, y = x.to(self.device), y.to(self.device)
        losses: list[torch.Tensor] = []
        with vocab_parallel_loss(self.chunks):  # a vocabulary-parallel head's loss, forward and backward
            if self.mixed is not None:
                losses = self.mixed.step(x if self.plan.first else None, y if self.plan.last else None)
            else:
                args = (x,) if self.plan.first else ()
                self.schedule.step(
                    *args,
                    target=y if self.plan.last else None,
                    losses=losses if self.plan.last else None,
                    return_outputs=False,
                )
        t_sync = time.perf_counter()
        grad_norm = None
        if lr is not None:  # the schedule's rate for this step (runner.optim.TrainSettings)
            set_lr(self.optimizer, lr)
        if self.zero is not None:  # gradient sync, clipping, sharded step and write-back in one (runner.zero)
            grad_norm = self.zero.finish_step(self.settings.clip_grad_norm)
            t_opt = time.perf_counter()
        else:
            self._sync_gradients()
            if self.settings.clip_grad_norm > 0:
                grad_norm = self._clip_gradients(self.settings.clip_grad_norm)
            t_opt = time.perf_counter()
            self.optimizer.step()
        if self.expert_sync is not None:  # send updated experts / SPES synchronisation (runner.moe)
            self.expert_sync.after_step(step_index, self.zero.in_turn if self.zero is not None else None)
        if recorder:
            recorder.add("allreduce", t_sync, t_opt)
            recorder.add("optimizer", t_opt, time.perf_counter())
            for stage in self.stages:
                stage.recorder = None
        # Global loss (and an agreed stop flag) in one all-reduce: the last stage of each pipeline
        # contributes its share of the mean.
        contrib = 0.0
        if self.plan.last and self.plan.tp_index == 0 and losses and self.mixed is not None:
            contrib = float(torch.stack([loss.detach().float() for loss in losses]).sum()) * self.mixed.scale
        elif self.plan.last and self.plan.tp_index == 0 and losses:
            contrib = float(torch.stack([loss.detach().float() for loss in losses]).mean()) * self.plan.grad_weight
        t = torch.tensor([contrib, 1.0 if stop_requested else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return StepResult(float(t[0]), bool(t[1] > 0), time.perf_counter() - t0, grad_norm)
