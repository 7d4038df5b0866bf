"""``python -m runner.torchrun ARGS``: ``torch.distributed.run`` (torchrun) that dies with its parent.

``autotune train`` starts torchrun through this module: it arms ``autotune.lifeline.die_with_parent``
(SIGKILL when ``autotune train`` dies, even of SIGKILL) and names itself the ranks' parent
(``AUTOTUNE_PARENT_PID``), so each rank, which arms the same on start (``runner.worker``), dies with it.
"""

from __future__ import annotations

import os
import sys

from autotune.lifeline import PARENT_ENV, die_with_parent

if __name__ == "__main__":
    die_with_parent()
    os.environ[PARENT_ENV] = str(os.getpid())
    from torch.distributed.run import main

    sys.argv[0] = "torchrun"
    main()
