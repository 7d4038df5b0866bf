"""torchtitan 0.3's own configuration code over exported config modules (run by test_engine_parsers.py with
``PYTHONPATH=.engines/site``; prints one ``RESULT {json}`` line).

Each module is loaded as ``torchtitan.train`` loads it, and then taken as far as torchtitan goes without
GPUs, in one process with torch's fake process group of the plan's world size (torchtitan's own dry-run
mode, ``comm.mode = "fake_backend"``):

1. ``ConfigManager().parse_args(["--module", M, "--config", "autotune_plan"])``: the module, tyro's parse
   and ``Trainer.Config.__post_init__`` (the pipeline micro-batch check among them);
2. ``ParallelDims.from_config(...)`` and ``build_mesh()``: the degrees multiply to the world size and every
   mesh (dense, expert, batch, loss) builds;
3. the trainer's batch check (``Trainer.__init__``: the global batch a multiple of the local batch times the
   batch degree; copied, as it sits inside the trainer's constructor), and the gradient accumulation steps;
4. the model built on the meta device as the trainer builds it, and with a pipeline, torchtitan's own
   ``_pipeline_module_split`` of it by ``module_fqns_per_model_part``: every part's modules exist, each
   block on exactly one stage.

With ``bases`` as the first argument instead: the shape of the model of each of autotune's ``BASES``
(blocks, hidden size, heads, kv heads, vocabulary, experts), as torchtitan builds it.
"""

import json
import logging
import os
import sys
import warnings

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.distributed.pipeline_parallel import _build_get_mesh_callback, _pipeline_module_split  # noqa: E402

out = {}
if sys.argv[1] == "bases":
    import importlib

    for base in json.loads(sys.argv[2]):
        module, function = base.split(":")
        model = getattr(importlib.import_module(module), function)().model_spec.model
        block = model.layers[0]
        attention = block.attention
        moe = next((b.moe for b in model.layers if getattr(b, "moe", None) is not None), None)
        experts = moe.num_experts if moe is not None else 0
        heads = (attention.n_heads, getattr(attention, "n_kv_heads", None) or attention.n_heads)
        out[base] = [len(model.layers), model.dim, *heads, model.vocab_size, experts]
    print("RESULT " + json.dumps(out))
    sys.exit(0)
for name, path in json.loads(sys.argv[1]):
    lines = open(path).read().splitlines()
    ranks = next(int(x.split()[1]) for x in lines if x.startswith("# ") and " ranks (dp " in x)
    sys.path.insert(0, os.path.dirname(path))
    try:
        config = ConfigManager().parse_args(["--module", os.path.basename(path)[:-3], "--config", "autotune_plan"])
        dist.init_process_group("fake", rank=0, world_size=ranks)
        dims = ParallelDims.from_config(config.parallelism, ranks)
        dims.build_mesh()
        local, batch = config.training.local_batch_size, dims.dp_replicate * dims.dp_shard
        gbs = config.training.global_batch_size
        assert gbs % (local * batch) == 0, f"global batch {gbs} % ({local} * {batch}) != 0"
        with torch.device("meta"):
            model = config.model_spec.model.build()
        stages = 1
        if dims.pp_enabled:
            parts = config.parallelism.module_fqns_per_model_part
            blocks = [m for part in parts for m in part if m.startswith("layers.")]
            assert sorted(blocks) == sorted(f"layers.{i}" for i in range(len(model.layers))), "blocks not split once"
            split, _ = _pipeline_module_split(
                model,
                dims.get_mesh("pp"),
                config.parallelism.pipeline_parallel_schedule,
                torch.device("cpu"),
                parts,
                get_mesh=_build_get_mesh_callback(dims),
            )
            stages = len(split)
        # stages: the model chunks rank 0 holds (the virtual stages per pipeline rank)
        out[name] = ["ok", batch, dims.tp, dims.pp, stages, dims.ep, gbs // (local * batch)]
    except BaseException as e:
        out[name] = ["rejected", f"{type(e).__name__}: {e}"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.path.pop(0)
print("RESULT " + json.dumps(out))
