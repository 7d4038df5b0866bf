"""``autotune.lifeline.stop_signals_end`` / ``communicate_all``: Ctrl-C while a process waits on its
children kills them, is raised again only once they are reaped, and never leaves a ``Popen`` wait lock
held (a held lock made the next ``Popen.wait()`` hang for ever: ``experiments/popen_interrupt_lock.py`` in the git history).

Each trial is interrupted by a burst of SIGINTs at random moments (a user pressing Ctrl-C repeatedly).
The trials run in a child process, so no stray SIGINT can reach pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from paths import REPO

REPO = REPO

STRESS = textwrap.dedent("""
    import os, random, signal, subprocess, sys, threading, time
    from autotune.lifeline import communicate_all, kill_all, stop_signals_end

    trial = {}

    def previous(signum, frame):  # the handler before the guard: the first call raises, as Ctrl-C does
        if trial.pop("armed", False):
            child = trial["child"]
            trial["seen"] = (child.returncode, child._waitpid_lock.locked())
            raise KeyboardInterrupt

    def burst():  # once the guard is in place: 1-4 SIGINTs 0-3 ms apart, starting 0-5 ms later
        while signal.getsignal(signal.SIGINT) is previous:
            time.sleep(0.0002)
        time.sleep(random.uniform(0, 0.005))
        for _ in range(random.randint(1, 4)):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(random.uniform(0, 0.003))

    signal.signal(signal.SIGINT, previous)
    bad = []
    for n in range(int(sys.argv[2])):
        child = subprocess.Popen(["sleep", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs = [child]
        trial.update(armed=True, child=child, seen=None)
        sender = threading.Thread(target=burst)
        sender.start()
        t0 = time.monotonic()
        interrupted = False
        try:
            if sys.argv[1] == "communicate":
                communicate_all(procs, 60)
            else:  # the launcher's loop: poll until the handler has killed the child, then reap it
                with stop_signals_end(lambda: kill_all(procs)) as stopped:
                    while not stopped:
                        child.poll()
                    child.wait()
        except KeyboardInterrupt:
            interrupted = True
        sender.join()
        time.sleep(0.01)  # a SIGINT still on its way lands here (a no-op now)
        # raised once, after the child was killed and reaped, with its wait lock free
        if not interrupted or trial["seen"] != (-signal.SIGKILL, False) or time.monotonic() - t0 > 30:
            bad.append((n, interrupted, trial["seen"], child.returncode))
        if child.returncode is None:
            child.kill()
            child.wait()
    print("bad", bad)
""")


def _stress(mode: str, trials: int) -> str:
    r = subprocess.run(
        [sys.executable, "-c", STRESS, mode, str(trials)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    return r.stdout + r.stderr


def test_ctrl_c_bursts_while_communicating_kill_and_reap_the_children_first():
    out = _stress("communicate", 80)
    assert "bad []" in out, out


def test_ctrl_c_bursts_in_a_poll_loop_never_leave_the_wait_lock_held():
    out = _stress("poll", 80)
    assert "bad []" in out, out
