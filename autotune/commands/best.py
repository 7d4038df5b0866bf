"""``autotune best``: print the best plan recorded in MLflow (SPEC.md config JSON plus "measurement")."""

from __future__ import annotations

import json


def run(experiment: str | None, tracking_uri: str | None) -> int:
    from autotune.search.tracking import read_best

    from autotune.commands.search import quiet_libraries

    quiet_libraries()
    config, measurement, _ = read_best(experiment, tracking_uri)
    doc = config.to_dict()
    doc["measurement"] = measurement.to_dict()
    print(json.dumps(doc, indent=2))
    return 0
