"""One rank of a runner job: ``python -m runner.worker JOB.json``.

Started by ``runner.launch`` (profiled runs: RANK / WORLD_SIZE in the environment, ``file://``
rendezvous from the job) or by ``torchrun`` (``autotune train``: env:// rendezvous). Rank 0 writes
the result to ``<out_dir>/result.json``; a rank that fails writes ``<out_dir>/error-rank<r>.json``
and exits 1, so the launcher can say which rank failed and why.

Test-only fault injection: ``AUTOTUNE_FAULT=raise:rank1`` makes rank 1 raise before its first step,
``AUTOTUNE_FAULT=hang:rank1`` makes it sleep forever. Used by tests/integration/runner/test_runner_faults.py; never set
it otherwise.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

log = logging.getLogger("runner.worker")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes(status_path: str = "/proc/self/status") -> int:
    """This process's own peak RSS: ``VmHWM`` from ``/proc/self/status``. Not ``getrusage().ru_maxrss``
    where /proc has it: Linux carries that over from the parent across fork + exec, so a rank launched
    from a big process (a search holding a policy, a notebook) would report the parent's size. Falls
    back to ``ru_maxrss`` where /proc is missing."""
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _inject_fault(rank: int) -> None:
    spec = os.environ.get("AUTOTUNE_FAULT", "")
    if not spec:
        return
    kind, _, who = spec.partition(":")
    if who != f"rank{rank}":
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault (AUTOTUNE_FAULT={spec})")
    if kind == "hang":
        while True:
            time.sleep(3600)


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return "out of memory" in text.lower() or "can't allocate memory" in text.lower()


def main(argv: list[str]) -> int:
    from autotune.lifeline import die_with_parent

    die_with_parent()  # SIGKILL when the launcher (or torchrun) dies, however it dies
    # a crash in native code (a segfault, glibc's abort on a corrupted heap) prints every thread's Python stack to
    # this rank's stderr, which a failed run's report quotes (runner.launch.output_tail)
    faulthandler.enable(all_threads=True)
    job_path = Path(argv[0])
    job = json.loads(job_path.read_text())
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    out_dir = Path(job["out_dir"])
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s"
    )
    try:
        run(job, rank, world, local_rank)
        return 0
    except BaseException as exc:  # report every failure, then exit non-zero
        if isinstance(exc, SystemExit) and not exc.code:
            return 0
        root = exc
        while root.__cause__ is not None:  # pipelining wraps stage errors; report the original
            root = root.__cause__
        lines = [line.strip() for line in str(root).splitlines() if line.strip()]
        err = {
            "rank": rank,
            "type": type(root).__name__,
            "message": lines[0] if lines else "",
            "oom": _is_oom(root),
            "time": time.time(),
            "traceback": traceback.format_exc(),
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"error-rank{rank}.json").write_text(json.dumps(err))
        log.error("rank %d failed: %s: %s", rank, err["type"], err["message"])
        return 1


def run(job: dict, rank: int, world: int, local_rank: int) -> None:
    import torch
    import torch.distributed as dist

    from autotune.errors import SpecError
    from runner.jobs import read_job, uses_cuda
    from runner.layout import build_layout

    torch.set_num_threads(1)
    cluster, model, config = read_job(job)
    if config.is_roundpipe:  # one process drives the pool through the roundpipe library: no process group
        from runner.roundpipe_run import run_job

        torch.set_num_threads(max(1, os.cpu_count() or 1))  # the host optimizer steps every parameter
        run_job(job, cluster, model, config, fault=_inject_fault)
        return
    layout = build_layout(cluster, model, config)
    if world != layout.world_size:
        raise SpecError(
            "runner",
            "world size",
            f"launched {world} ranks but the config has {layout.world_size} devices (one rank per device)",
        )
    cuda = uses_cuda(cluster, config, torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # precision fp32 means TF32 matmuls where the GPU has them (docs/formats.md); bf16 autocast keeps
        # a few fp32 matmuls (none in the blocks), which TF32 also speeds up
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=float(job.get("pg_timeout_s", 600)))
    init_method = job.get("init_method") if "MASTER_ADDR" not in os.environ else "env://"
    baseline_rss = _rss_bytes()
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device if cuda else None,
    )
    try:
        if job["mode"] == "profile":
            from runner.profile import profile_rank

            profile_rank(
                job, layout, cluster, model, config, rank, device, baseline_rss, _peak_rss_bytes, fault=_inject_fault
            )
        elif job["mode"] == "train":
            from runner.train import train_rank

            train_rank(job, layout, model, config, rank, device, fault=_inject_fault)
        else:
            raise ValueError(f"unknown job mode {job['mode']!r}")
        # every rank done: leave together, so no rank tears its connections down while a peer still
        # finishes its last point-to-point transfer (a finished run once exited 1 at teardown)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown: every result and checkpoint is written and the process group
    destroyed by now, and what the teardown still does (freeing torch's C++ objects, gloo's threads among
    them, in whatever order the garbage comes) once aborted a finished rank under load ("terminate called
    without an active exception", SIGABRT after its last step: tests/integration/runner/test_mixed_runner.py
    turned red once in ~120 runs). Output is flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))
