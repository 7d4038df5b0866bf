"""torchtitan's checkpointing modes (``"selective-op"``, ``"every-N"``): the runner keeps exactly what the
simulator's memory terms say, computes the same gradients as without recomputation, and the plan
format takes and refuses them in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autotune.calibration.bench import saved_activation_bytes
from autotune.errors import SpecError
from autotune.simulator.memory import (
    layer_activation_bytes,
    layer_input_bytes,
    layer_op_kept_bytes,
    stage_activation_bytes,
)
from autotune.specs import ModelSpec, ParallelConfig
from autotune.specs.recompute import checkpointed_blocks, is_checkpointed, recompute_problem
from runner.model import _SAVED_OPS, StageChunk

torch.set_num_threads(1)


def spec(mlp: str, attention: str) -> ModelSpec:
    return ModelSpec(
        name="t",
        num_layers=4,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=176,
        mlp=mlp,
        vocab_size=256,
        seq_len=64,
        global_batch_size=8,
        attention=attention,
    )


def kept_bytes(chunk: StageChunk, x: torch.Tensor) -> int:
    """What the chunk's forward keeps for its backward: the tensors autograd saves (checkpoints' inputs
    included) plus the op outputs selective checkpointing caches (the outputs of ``_SAVED_OPS``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cached: dict[int, int] = {}
    matmuls = [0]

    per_block = 7 if chunk.blocks["0"].mlp.swiglu else 6  # Q, K, V, output, (gate,) up, down

    def keep(name: str) -> bool:
        """torchtitan's rule, counted here independently: every second linear matmul of a block is not kept."""
        if name in ("aten.mm.default", "aten.addmm.default"):
            matmuls[0] += 1
            return (matmuls[0] - 1) % per_block % 2 == 0
        return True

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if chunk.recompute == "selective-op" and str(func) in _SAVED_OPS and keep(str(func)):
                for t in out if isinstance(out, tuple) else (out,):
                    if isinstance(t, torch.Tensor):
                        cached[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return out

    with Record():
        saved = saved_activation_bytes(chunk, x, [p.data_ptr() for p in chunk.parameters()])
    return saved + sum(cached.values())


@pytest.mark.parametrize(("mlp", "attention"), [("swiglu", "flash"), ("gelu", "standard"), ("swiglu", "standard")])
def test_selective_op_keeps_what_the_simulator_counts(mlp: str, attention: str) -> None:
    """The runner's per-op checkpointing keeps each block's input and every other matmul's output (and
    fused attention's): the simulator's ``layer_op_kept_bytes`` to within fused attention's log-sum-exp
    (``a s b`` fp32 values)."""
    m = spec(mlp, attention)
    chunk = StageChunk(m, range(4), first=False, last=False, seed=1, recompute="selective-op")
    measured = kept_bytes(chunk, torch.randn(2, m.seq_len, m.hidden_size, requires_grad=True)) / 4
    predicted = layer_op_kept_bytes(m, 2, 1, elem_bytes=4)
    lse = 4 * m.num_heads * m.seq_len * 2 if attention == "flash" else 0
    assert measured == pytest.approx(predicted + lse, rel=1e-9)
    assert predicted < layer_activation_bytes(m, 2, 1, elem_bytes=4)


def test_every_n_checkpoints_every_nth_block_of_a_chunk() -> None:
    """every-2 over 4 blocks: blocks 2 and 4 keep only their inputs, blocks 1 and 3 everything."""
    m = spec("swiglu", "flash")
    x = torch.randn(2, m.seq_len, m.hidden_size, requires_grad=True)
    kept = {
        mode: kept_bytes(StageChunk(m, range(4), first=False, last=False, seed=1, recompute=mode), x)
        for mode in (False, True, "every-2")
    }
    assert kept[True] == 4 * layer_input_bytes(m, 2, elem_bytes=4)
    assert kept["every-2"] == (kept[False] + kept[True]) / 2
    assert [is_checkpointed("every-3", i) for i in range(7)] == [False, False, True, False, False, True, False]
    assert checkpointed_blocks("every-3", 7) == 2 and checkpointed_blocks(True, 7) == 7
    assert checkpointed_blocks("selective-op", 7) == 0


def test_every_mode_computes_the_gradients_of_no_recomputation() -> None:
    m = spec("swiglu", "standard")
    x = torch.randn(2, m.seq_len, m.hidden_size)
    grads = {}
    for mode in (False, True, "selective", "selective-op", "every-2", "every-3"):
        chunk = StageChunk(m, range(4), first=False, last=False, seed=1, recompute=mode)
        xi = x.clone().requires_grad_(True)
        (chunk(xi) ** 2).mean().backward()
        grads[mode] = [xi.grad] + [p.grad for _, p in sorted(chunk.named_parameters())]
    for mode, g in grads.items():
        for a, b in zip(g, grads[False]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=lambda s, mode=mode: f"{mode}: {s}")


def test_stage_memory_of_the_new_modes_by_hand() -> None:
    """A GPT-like layer (h 1024, 16 heads, f 4h, GeLU, flash, no dropout) in bf16 (e 2), s 2048, b 1,
    tp 1. Without recomputation it keeps 4h (two norm inputs, attention and MLP inputs) + 3h (Q, K, V)
    + h (the output projection's input) + 2f (GeLU's input and the second matrix's input) = 16h
    elements per token; per-op checkpointing keeps 3h (input, both projections' outputs) + 3h (Q, K,
    V) + h (attention output) + f (the first MLP matmul's output) = 11h if every matmul's output were
    kept; torchtitan's policy keeps every other one (Q and V, not K; fc1, not fc2): h (input) + h (Q)
    + h (V) + h (attention output) + 4h (fc1) = 8h."""
    m = ModelSpec(
        name="g",
        num_layers=8,
        hidden_size=1024,
        num_heads=16,
        ffn_hidden_size=4096,
        mlp="gelu",
        vocab_size=1000,
        seq_len=2048,
        global_batch_size=8,
        dropout=0.0,
    )
    sbh = 2048 * 1024
    full = sbh * 2 * (4 + 1 + 2 + 1 + 8)  # norms/attn/MLP inputs 4h, Q h, K V 2h, o-proj input h, MLP 2f = 8h
    op = sbh * 2 * (1 + 1 + 1 + 1 + 4)  # input, Q, V, attention output, fc1
    assert layer_activation_bytes(m, 1, 1) == full
    assert layer_op_kept_bytes(m, 1, 1) == op
    inp = sbh * 2
    # stage of 8 layers, 3 micro-batches in flight, one chunk, in the middle of the pipeline
    assert stage_activation_bytes(m, 1, 1, 8, "selective-op", 3, 1, False, False) == 3 * 8 * op + (full - op)
    assert stage_activation_bytes(m, 1, 1, 8, "every-2", 3, 1, False, False) == 3 * (4 * inp + 4 * full) + full
    assert stage_activation_bytes(m, 1, 1, 8, "every-4", 3, 1, False, False) == 3 * (2 * inp + 6 * full) + full
    # sequence parallelism over tp 2 splits the kept input; Q, V, attention output and fc1 are split by tp
    assert layer_op_kept_bytes(m, 1, 2, sequence_parallel=True) == sbh * 2 * (0.5 + (1 + 1 + 1 + 4) / 2)
    swiglu = replace(m, mlp="swiglu", num_kv_heads=4)  # kv 256 wide; SwiGLU also keeps its down output
    assert layer_op_kept_bytes(swiglu, 1, 1) == 2048 * 2 * (1024 + 1024 + 256 + 1024 + 4096 + 1024)


def test_the_plan_format_takes_the_new_modes_and_refuses_bad_ones() -> None:
    def plan(mode):
        return ParallelConfig.from_dict(
            {
                "micro_batch_size": 1,
                "pipelines": [
                    {"num_microbatches": 2, "stages": [{"devices": ["n:0"], "layers": 4, "recompute": mode}]}
                ],
            }
        )

    for mode in ("selective-op", "every-2", "every-16"):
        assert plan(mode).pipelines[0].stages[0].recompute == mode
        assert ParallelConfig.from_json(plan(mode).to_json()) == plan(mode)
    for bad in ("every-1", "every-0", "every-x", "every-", "sometimes", 2):
        with pytest.raises(SpecError, match=r"recompute: must be true, false, \"selective\", \"selective-op\""):
            plan(bad)
        assert recompute_problem(bad) is not None


def test_the_runner_policy_keeps_every_other_matmul_of_a_block_and_fused_attention() -> None:
    """``runner.model._op_policy`` on a SwiGLU block's op sequence: Q kept, K rerun, V kept, attention kept,
    output projection rerun, gate kept, up rerun, down kept; its recomputation counts afresh."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from runner.model import _op_policy

    mm, sdpa, add = "aten.mm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten.add.Tensor"
    ops = [mm, mm, mm, sdpa, mm, add, mm, mm, mm]
    policy = _op_policy()
    for recompute in (False, True):
        ctx = SimpleNamespace(is_recompute=recompute)
        saved = [policy(ctx, op) == CheckpointPolicy.MUST_SAVE for op in ops]
        assert saved == [True, False, True, True, False, False, True, False, True]
