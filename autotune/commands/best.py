"""``autotune best``: print the best plan recorded in MLflow (SPEC.md config JSON plus "measurement")."""

from __future__ import annotations

import json


def run(experiment: str | None, tracking_uri: str | None) -> int:
    from autotune import prechecks
    from autotune.commands.status import loading
    from autotune.search.tracking import quiet_libraries

    prechecks.tracking_uri(tracking_uri)
    quiet_libraries()
    with loading(f"loading MLflow to read {tracking_uri or 'sqlite:///mlflow.db'}"):
        from autotune.search.history import read_best

        config, measurement, _ = read_best(experiment, tracking_uri)
    doc = config.to_dict()
    doc["measurement"] = measurement.to_dict()
    print(json.dumps(doc, indent=2))
    return 0
