"""One rank's ZeRO state: its units (``runner.zero.Unit``, one per weight key it holds, or per part of a key
that replicas shard at different tensor-parallel degrees), their process groups, the optimizer over their
master shards, the step's padding and synchronisation, and sharded checkpoints."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from runner.layout import EMBED_KEY, HEAD_KEY, WHOLE_PART, Layout, replicas_out_of_step, unit_label
from runner.optim import make_optimizer
from runner.reshard import parts_of
from runner.zero import SharedWeights, Unit


def _tp_sharded(p) -> bool:
    """A weight split across its tensor-parallel ranks (a DTensor with a ``Shard`` placement)."""
    return isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)


class ShardedState:
    """All units of one rank, their process groups and the optimizer over their master shards.

    Every rank constructs it (process groups are created by all ranks in one order)."""

    def __init__(
        self, layout: Layout, rank: int, module, device: torch.device, experts: bool = False, vocab_size: int = 0
    ) -> None:
        self.layout = layout
        self.device = device
        self.plan = layout.ranks[rank]
        self.units: list[Unit] = []
        # micro-batches each rank runs: its share in a mixed stage (runner.mixed), else its pipeline's
        counts = {r.rank: r.share or r.num_microbatches for r in layout.ranks}
        # the reductions a rank makes of a unit per step (zero 3: and twice as many gathers): one per micro-batch,
        # or one per pass where it runs layer-wise (``runner.layerwise``); its peers pad to the most
        passes = {r.rank: 1 if r.layerwise else counts[r.rank] for r in layout.ranks}
        # runner.mixed weighs each micro-batch's loss by its part of the global batch already
        self.grad_weight = 1.0 if layout.mixed else self.plan.grad_weight
        #: an MoE / SPES plan (``experts``): each key's unit is its trainers (``Layout.key_trainers``), with
        #: their gradient weights; a SPES plan's units are per expert-parallel group (its checkpoint names say which)
        self.scope = f".g{self.plan.expert_group}" if experts and layout.sync_every_steps > 1 else ""
        units = layout.key_trainers() if experts else layout.key_holders()
        # experts this rank holds and does not train (SPES): no unit, but saved and restored with the shards
        names = {p: n for n, p in module.named_parameters()}
        self.frozen = {
            names[p]: p for key in self.plan.holds() if not self.plan.trains(key) for p in module.params_of(key)
        }
        specs = self._unit_specs(units, experts)
        # replicas whose schedules reach the units in different orders, or ranks holding different numbers of
        # units of a key (its parts: ``_unit_specs``): reduce-scatters without waiting
        asynchronous = replicas_out_of_step(layout) or self.resharded
        # and zero 3's gathers served point to point (``Unit._serve``): every holder gathers each unit twice
        # per micro-batch it runs, or per layer-wise pass (forward, backward; a recomputation reuses the
        # backward's gather); where every rank runs layer-wise, all make the same gathers in layer order
        served = asynchronous and layout.zero >= 3 and not all(r.layerwise for r in layout.ranks)
        self.shared = SharedWeights()
        tp = (self.plan.tp_degree, self.plan.tp_index)
        for key, label, holders, weights, part in specs:
            groups = (
                (dist.new_group(list(holders)), dist.new_group(list(holders))) if len(holders) > 1 else (None, None)
            )
            if rank not in holders:
                continue
            params, pieces = parts_of(module.params_of(key), names, part, *tp, vocab_size)
            if not params:
                continue
            if key == EMBED_KEY:
                modules = [module.embed]
            elif key == HEAD_KEY:
                modules = [module.norm, module.head]
            elif ".expert" in key:
                layer, _, expert = key.removeprefix("layer").partition(".expert")
                modules = [module.blocks[layer].mlp.experts[expert]]
            else:
                modules = [module.blocks[key.removeprefix("layer")]]
            unit = Unit(
                key,
                params,
                modules,
                holders,
                rank,
                layout.zero,
                self.plan.offload,
                device,
                *groups,
                max(passes[h] for h in holders),
                passes[rank],
                asynchronous=asynchronous,
                gathers_of={h: 2 * passes[h] for h in holders} if served else None,
                pieces=pieces,
                shared=self.shared,
            )
            unit.label = label
            if part is None and self.plan.tp_degree > 1:  # weights each tensor-parallel rank keeps whole
                unit.tp_copies = [1 if _tp_sharded(q) else self.plan.tp_degree for q in params]
            if weights is None:  # every holder trains the key: its replica's share of the batch
                unit.weight = self.grad_weight
                unit.factor = 1.0 if layout.mixed else 1.0 / layout.total_microbatches
                if part is not None and part[0] == WHOLE_PART:  # its tp ranks hold one gradient (runner.reshard)
                    unit.weight /= self.plan.tp_degree
                    unit.factor /= self.plan.tp_degree
            else:  # the exchange's weight (of the pipeline's mean gradient), per micro-batch over its count
                unit.weight = weights[rank]
                unit.factor = weights[rank] if layout.mixed else weights[rank] / counts[rank]
            self.units.append(unit)
        for u in self.units:
            for p in u.params:
                self.shared.users[p] = self.shared.users.get(p, 0) + 1
            u.free_parts()
        masters = [u.master for u in self.units]
        # fused AdamW on the master shards (``runner.optim.make_optimizer``; in host memory with offload, as
        # ZeRO-Offload's CPU Adam); ``runner.engine`` sets the step's rate and weight decay
        self.optimizer = make_optimizer(masters)

    def _unit_specs(self, units, experts: bool) -> list[tuple]:
        """(key, label, holders, weights, part) of every unit of the plan, in one order on every rank: one per
        key and tensor-parallel shard; a key replicas shard at different degrees (``Layout.resharded``) one
        per part ``(c, t)`` of its sharded weights (the holders one rank per replica) and one for the weights
        every holder keeps whole (``c`` = ``WHOLE_PART``). An MoE / SPES plan's are ``Layout.key_trainers``."""
        if experts:
            self.resharded = any(u[4] is not None for u in units)
            return list(units)
        resharded = self.layout.resharded()
        self.resharded = bool(resharded)
        specs, done = [], set()
        for key, tp_index, holders in units:
            if key not in resharded:
                specs.append((key, unit_label(None, tp_index), holders, None, None))
            elif key not in done:
                done.add(key)
                t, parts, every = resharded[key]
                members = [(WHOLE_PART, every)] + list(enumerate(parts))
                specs += [(key, unit_label((c, t), 0), ranks, None, (c, t)) for c, ranks in members]
        return specs

    @property
    def streamed(self) -> bool:
        return any(u.streamed for u in self.units)

    def units_of(self, key: str) -> list[Unit]:
        """This rank's units of weight key ``key`` and, for a block, of its experts (``layer<i>.expert<e>``)."""
        return [u for u in self.units if u.key == key or u.key.startswith(f"{key}.expert")]

    def host_bytes(self) -> int:
        return sum(u.host_bytes() for u in self.units)

    def begin_step(self) -> None:
        for u in self.units:
            u.begin_step()

    def finish_step(self, clip_grad_norm: float = 0.0) -> float | None:
        """Pad the per-micro-batch collectives, synchronise gradients, clip them by their global norm
        (``clip_grad_norm`` > 0: the norm before, as ``torch.nn.utils.clip_grad_norm_`` on the whole model),
        step AdamW on the master shards, write the weights back."""
        for u in self.units:
            if u.gathers_of is not None and u.received != u.gathers_of[u.holders[u.index]]:
                raise RuntimeError(
                    f"runner.zero: {u.key} was gathered {u.received} times this step, its peers served "
                    f"{u.gathers_of[u.holders[u.index]]} (two per micro-batch): a schedule this rank runs "
                    "gathers a unit other than once per forward and once per backward"
                )
        pads = max((u.pads for u in self.units), default=0)
        with torch.no_grad():
            for i in range(pads):  # replay a micro-batch's collective order (replicas in step: single stages)
                for u in self.units:  # forward: first unit to last
                    if i < u.pads and u.gathers and u.gathers_of is None:
                        u.pad_gather()
                for u in reversed(self.units):  # backward: last unit to first
                    if i < u.pads and u.gathers and u.gathers_of is None:
                        u.pad_gather()
                    if i < u.pads and u.scatter_per_mb:
                        u.reduce_microbatch(pad=True)
        for u in self.units:
            u.finish_step(u.weight)
        norm = self._clip(clip_grad_norm) if clip_grad_norm > 0 else None
        self.optimizer.step()
        for u in self.units:
            u.write_back()
        return norm

    def _clip(self, max_norm: float) -> float:
        """Scale the master shards' gradients so the global norm (every rank's ``Unit.grad_square``) is at most
        ``max_norm``; the norm before."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for u in self.units:
            sq += u.grad_square().to(self.device)
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        scale = max_norm / (norm + 1e-6)
        if scale < 1.0:
            for u in self.units:
                u.master.grad.mul_(scale)
        return norm

    @property
    def per_microbatch(self) -> bool:
        """Whether some unit makes collective calls per micro-batch (gathers or reduce-scatters): then every
        holder must run every unit on every micro-batch (an MoE block runs each expert, tokens or none)."""
        return any(u.gathers or u.scatter_per_mb for u in self.units)

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every unit's weights present while the block runs (streamed units gathered in unit order on every
        rank, freed after): a checkpoint that stores the full weights beside the shards (``--save-hf``);
        under ZeRO-3 / offload ``all`` the rank then holds its stage's weights whole, as ZeRO-1/2 always do."""
        for u in self.units:
            u.materialise()
        try:
            yield
        finally:
            for u in self.units:
                u.unmaterialise()

    def in_turn(self, keys: list[tuple[str, ...]]) -> Iterator[int]:
        """Each index ``i`` of an exchange's groups (``keys[i]``: group ``i``'s weight keys, the same list on
        every rank: ``runner.moe.ExpertSync``), with this rank's units of those keys whole while the group
        reads and writes them: a streamed unit is gathered (``Unit.materialise``) before the first group that
        names its key and, after the last, its master shard reloaded from the exchanged weights, its shard
        rewritten and its parameters freed (``Unit.settle``); a resident unit's master is reloaded there. Every
        rank gathers and settles in one order (group, then unit), so the collectives pair up, and only the
        units of the keys in exchange are whole at once, as in a pass."""
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, group in enumerate(keys):
            for key in group:
                first.setdefault(key, i)
                last[key] = i
        for i in range(len(keys)):
            for u in self.units:
                if u.streamed and first.get(u.key) == i:
                    u.materialise()
            yield i
            for u in self.units:
                if last.get(u.key) == i:
                    u.settle() if u.streamed else u.reload_master()

    # -- checkpoints -------------------------------------------------------------------------------
    def _name(self, u: Unit) -> str:
        shard = u.index if u.n_shards > 1 else 0
        return f"{u.key}{self.scope}.{u.label}.shard{shard}of{u.n_shards if u.n_shards > 1 else 1}"

    def state_dict(self) -> dict:
        """This rank's shards under names that say which shard they are (a sharded checkpoint is
        resumed by the same plan)."""
        out = {}
        for u in self.units:
            state = self.optimizer.state.get(u.master, {})
            name = self._name(u)
            if u.n_shards == 1 and u.index > 0:
                continue  # an unsharded unit's replicas hold the same state: rank 0 of its holders saves it
            out[f"{name}.master"] = u.master.detach()
            if state:
                out[f"{name}.exp_avg"] = state["exp_avg"]
                out[f"{name}.exp_avg_sq"] = state["exp_avg_sq"]
                out[f"{name}.step"] = state["step"]
        for name, p in self.frozen.items():  # every holder's copy is the same (the last exchange's)
            out[f"frozen.{name}"] = p.detach()
        return out

    def empty_state_dict(self, steps_done: bool) -> dict:
        """Tensors of the right shapes for loading into (every unit, as a resumed rank needs them)."""
        out = {}
        for u in self.units:
            name = self._name(u)
            out[f"{name}.master"] = torch.empty_like(u.master.detach())
            if steps_done:
                out[f"{name}.exp_avg"] = torch.empty_like(u.master.detach())
                out[f"{name}.exp_avg_sq"] = torch.empty_like(u.master.detach())
                out[f"{name}.step"] = torch.zeros((), dtype=torch.float32)
        for name, p in self.frozen.items():
            out[f"frozen.{name}"] = torch.empty_like(p.detach())
        return out

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for u in self.units:
                name = self._name(u)
                u.master.copy_(state[f"{name}.master"])
                if f"{name}.exp_avg" in state:
                    self.optimizer.state[u.master] = {
                        "step": state[f"{name}.step"].clone(),
                        "exp_avg": state[f"{name}.exp_avg"].clone().to(u.master.device),
                        "exp_avg_sq": state[f"{name}.exp_avg_sq"].clone().to(u.master.device),
                    }
                u.write_back()
            for name, p in self.frozen.items():
                p.copy_(state[f"frozen.{name}"])
