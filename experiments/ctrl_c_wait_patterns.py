"""Ctrl-C bursts against the ways a process waits on a child (issue 14): the old patterns (a plain
``communicate`` / ``poll`` loop with a ``finally`` that kills and waits) against
``autotune.lifeline.communicate_all`` and ``stop_signals_end``.

Each trial starts ``sleep 60`` and sends this process 1-4 SIGINTs 0-3 ms apart (0-5 ms after the
wait began; for the guarded patterns, after the guard is in place). A trial is bad when the first
KeyboardInterrupt was raised before the child was killed and reaped, or the wait lock was left held;
"hung" counts the old patterns' final ``wait(timeout=5)`` giving up on a held lock (unguarded, it
would block for ever).

    python experiments/ctrl_c_wait_patterns.py 80
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from autotune.lifeline import communicate_all, kill_all, stop_signals_end  # noqa: E402

trial: dict = {}


def previous(signum, frame):  # the handler before any guard: the first call raises, as Ctrl-C does
    if trial.pop("armed", False):
        child = trial["child"]
        trial["seen"] = (child.returncode, child._waitpid_lock.locked())
        raise KeyboardInterrupt


def burst(guarded: bool) -> None:
    while guarded and signal.getsignal(signal.SIGINT) is previous:
        time.sleep(0.0002)
    time.sleep(random.uniform(0, 0.005))
    for _ in range(random.randint(1, 4)):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(random.uniform(0, 0.003))


def wait(mode: str, child: subprocess.Popen) -> None:
    procs = [child]
    if mode == "old-communicate":  # calibration/bench.py, runtime_probe.py before
        try:
            child.communicate(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=5)
    elif mode == "old-poll":  # runner.launch.run_ranks before the deferral
        try:
            while True:
                child.poll()
        finally:
            child.kill()
            child.wait(timeout=5)
    elif mode == "communicate_all":
        communicate_all(procs, 60)
    else:  # stop_signals_end around a poll loop (run_ranks now)
        with stop_signals_end(lambda: kill_all(procs)) as stopped:
            while not stopped:
                child.poll()
            child.wait()


def run(mode: str, trials: int) -> tuple[int, int]:
    bad = hung = 0
    for _ in range(trials):
        child = subprocess.Popen(["sleep", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        trial.update(armed=True, child=child, seen=None)
        sender = threading.Thread(target=burst, args=(not mode.startswith("old"),))
        interrupted = False
        try:
            sender.start()
            wait(mode, child)
        except KeyboardInterrupt:
            interrupted = True
        except subprocess.TimeoutExpired:
            hung += 1
        sender.join()
        time.sleep(0.01)
        bad += not interrupted or trial["seen"] != (-signal.SIGKILL, False)
        if child._waitpid_lock.locked():
            child._waitpid_lock.release()
        if child.returncode is None:
            child.kill()
            child.wait()
    return bad, hung


def main(trials: int) -> None:
    signal.signal(signal.SIGINT, previous)
    for mode in ("old-communicate", "old-poll", "communicate_all", "stop_signals_end"):
        bad, hung = run(mode, trials)
        print(f"{mode:17s} {bad:3d} of {trials} trials bad, {hung} hung on a held wait lock")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 80)
