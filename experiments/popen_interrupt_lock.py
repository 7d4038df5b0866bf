"""Why ``runner.launch`` defers SIGINT / SIGTERM instead of letting ``KeyboardInterrupt`` fly (issue 14).

A ``KeyboardInterrupt`` raised while the main thread is inside ``subprocess.Popen.poll()`` can land
just after ``poll()`` took the Popen's ``_waitpid_lock`` and before its ``try``: the lock stays held
and every later ``Popen.wait()`` on that process blocks for ever. The launcher's ``finally`` reaps
the ranks it killed with ``Popen.wait()``, so it hung (tests/test_runner_signals.py [default-2]
failed on a loaded machine, where the main thread is more often descheduled inside ``poll()``).

This script interrupts a ``poll()`` loop N times (an interval timer whose handler is Python's
default SIGINT handler) and counts how often the lock was left held.

    python experiments/popen_interrupt_lock.py 3000
"""

import random
import signal
import subprocess
import sys


def main(trials: int) -> None:
    child = subprocess.Popen(["sleep", "600"])
    signal.signal(signal.SIGALRM, signal.default_int_handler)  # raises KeyboardInterrupt, as Ctrl-C does
    leaks = 0
    try:
        for _ in range(trials):
            try:
                signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0001, 0.002))
                while True:
                    child.poll()
            except KeyboardInterrupt:
                pass
            if child._waitpid_lock.locked():
                leaks += 1
                child._waitpid_lock.release()
    finally:
        child.kill()
        child.wait()
    print(
        f"{leaks} of {trials} KeyboardInterrupts raised in a Popen.poll() loop left its _waitpid_lock held "
        f"(Python {sys.version.split()[0]})"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
