"""Suite-wide set-up.

Ctrl-C for the processes tests start: a shell runs a background command (``make test > log &``,
``nohup``) with SIGINT ignored, and an ignored signal stays ignored across fork and exec, so every
command a test started would ignore the SIGINT the test sends it: the launcher and search Ctrl-C tests
then waited out the run (``test_stopping_the_launcher_kills_the_ranks[default-2]``, ``test_ctrl_c_says_how_
to_resume_and_fresh_starts_over`` failed on every such fresh-clone ``make test``). The suite gives SIGINT
back its Python default here: a handler is reset to the default action by exec, so children start as
they would from a terminal (``tests/integration/cli/test_suite_signals.py``).
"""

from __future__ import annotations

import signal


def pytest_configure(config) -> None:
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
