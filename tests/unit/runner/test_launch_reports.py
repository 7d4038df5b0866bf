"""What a failed run says when a rank dies without a Python error (``runner.launch.killed_ranks``)."""

from __future__ import annotations

from runner.launch import killed_ranks

# torchrun's failure summary as it printed it for the fresh clone's heap corruption (rank 1 aborted by glibc),
# rank 3 exiting normally with an error, and a signal number Python has no name for
SUMMARY = """\
Failures:
[1]:
  time      : 2026-12-07_22:47:07
  host      : localhost
  rank      : 3 (local_rank: 3)
  exitcode  : 1 (pid: 14923)
  error_file: <N/A>
[2]:
  time      : 2026-12-07_22:47:07
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 14921)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 14921
[3]:
  rank      : 2 (local_rank: 2)
  exitcode  : -99 (pid: 14922)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 14920)
"""


def test_the_ranks_a_signal_killed_are_named_with_the_signal_in_rank_order():
    assert killed_ranks(SUMMARY) == ["rank 0 (SIGKILL)", "rank 1 (SIGABRT)", "rank 2 (signal 99)"]
    assert killed_ranks("rank      : 3 (local_rank: 3)\n  exitcode  : 1 (pid: 1)\n") == []
    assert killed_ranks("") == []
