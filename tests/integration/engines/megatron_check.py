"""Megatron-Core's own ``parse_args`` + ``validate_args`` over exported argument files (run by
test_engine_parsers.py with ``PYTHONPATH=.engines/site``; prints one ``RESULT {json}`` line).

Each file is read as a user launches it: its arguments, plus what its notes ask the user to add (data,
tokenizer, iterations, learning rate), with the environment its ``# environment:`` lines set (and nothing
else: ``CUDA_DEVICE_MAX_CONNECTIONS`` unset otherwise) and ``WORLD_SIZE`` its world size. Two stand-ins,
both for what this CPU-only 3.11 machine lacks, none for Megatron's checks: ``typing.override`` (Python 3.12;
Megatron-Core >= 0.17 is 3.12-only) from typing_extensions, and the one hardware query ``validate_args``
makes, ``get_device_arch_version``, answered with the GPU architecture given on the command line (9: Hopper).
"""

import json
import os
import shlex
import sys
import typing
import warnings

import typing_extensions

warnings.filterwarnings("ignore")
if not hasattr(typing, "override"):
    typing.override = typing_extensions.override

from megatron.training import arguments  # noqa: E402

ARCH = int(sys.argv[2])
arguments.get_device_arch_version = lambda: ARCH
ADDED = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--train-iters", "10", "--lr", "1e-4"]

out = {}
for name, path in json.loads(sys.argv[1]):
    lines = open(path).read().splitlines()
    world = next(int(x.split()[-1]) for x in lines if x.startswith("# world size"))
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    for x in lines:
        if x.startswith("# environment: ") and "=" in x.split()[2]:
            key, value = x.split()[2].split("=", 1)
            os.environ[key] = value
    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    flags = shlex.split(" ".join(x.rstrip("\\") for x in lines if not x.startswith("#")))
    sys.argv = ["pretrain_gpt.py", *flags, *ADDED]
    try:
        args = arguments.parse_args()
        arguments.validate_args(args, {})
        out[name] = [
            "ok",
            args.data_parallel_size,
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size or 1,
            args.expert_model_parallel_size,
        ]
    except BaseException as e:  # validate_args asserts; parse_args exits on an unknown flag
        out[name] = ["rejected", f"{type(e).__name__}: {e}"]
print("RESULT " + json.dumps(out))
