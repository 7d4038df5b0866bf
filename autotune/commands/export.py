"""``autotune export --to ENGINE PLAN``: the plan as torchtitan's, Megatron-LM's or DeepSpeed's own
configuration (``autotune.engines``); one line and exit 2 when the engine cannot run it."""

from __future__ import annotations

from pathlib import Path


def run(plan: Path, engine: str, cluster: str | None, model, output: Path | None) -> int:
    from autotune import engines, prechecks
    from autotune.loading import load_cluster, load_config, load_model

    if engine not in engines.ENGINES:  # the option is --to here, not search's --engine
        from autotune.errors import SpecError, shown

        raise SpecError("--to", "", f"must be one of {', '.join(engines.ENGINES)}, got {shown(engine)}")
    config = load_config(plan)
    model_spec = load_model(model) if model is not None else None
    if model_spec is not None:  # with or without the cluster: the layers, tp and batch against the model
        config.validate(load_cluster(cluster) if cluster is not None else None, model_spec, source=str(plan))
    elif cluster is not None:
        cluster_spec = load_cluster(cluster)
        missing = sorted(set(config.devices) - set(cluster_spec.device_ids()))
        if missing:
            from autotune.errors import SpecError

            raise SpecError(str(plan), "devices", f"not in cluster {cluster_spec.name}: {', '.join(missing[:8])}")
    if output is not None:
        prechecks.writable_file(output, "--output")
    text = engines.export(engine, config, model_spec)  # Inexpressible: one line, exit 2 (autotune.cli)
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    if output is None:
        print(text, end="")
    else:
        output.write_text(text)
        err.print(escape(f"{engines.ENGINES[engine].NAME} configuration written to {output}"))
    for note in engines.notes(engine, config, model_spec):  # what the user adds by hand
        err.print(escape(f"note: {note}"))
    return 0
