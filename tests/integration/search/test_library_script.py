"""The README's library example runs as written when saved as a script: ``python tune.py``, no
``if __name__ == "__main__":`` guard (the MLflow writer and Optuna's worker processes use the spawn start
method, which used to run the user's script again in the child and crash)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from paths import EXAMPLES, REPO


def _readme_library_example() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## The library") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readme_library_example_runs_as_a_script(tmp_path):
    code = _readme_library_example()
    assert "autotune.tune(" in code and "__main__" not in code
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    script = tmp_path / "tune.py"
    script.write_text(code + "\nprint('tokens/s', round(m.tokens_per_s))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bootstrapping phase" not in r.stderr and "Traceback" not in r.stderr
    assert re.search(r"tokens/s \d+", r.stdout)
