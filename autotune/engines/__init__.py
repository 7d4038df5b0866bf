"""Plans for the engines teams already train with: torchtitan, Megatron-LM, DeepSpeed (docs/engines.md).

``check(engine, config)`` says in one line why ``engine`` cannot run a plan (None when it can):
first the grid every such engine needs (``autotune.engines.grid``), then the engine's own rules.
``export(engine, config, model)`` writes the engine's configuration of a plan it can run;
``parse(engine, text)`` reads it back as a grid (round trips). ``autotune search --engine`` keeps the
search to plans ``check`` accepts; ``autotune export --to`` writes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from autotune.engines import deepspeed, megatron, torchtitan
from autotune.engines.grid import EngineGrid, Inexpressible, grid_of, rank_devices
from autotune.planning.vocabulary import same_choice
from autotune.specs import ModelSpec, ParallelConfig

ENGINES: dict[str, ModuleType] = {"torchtitan": torchtitan, "megatron": megatron, "deepspeed": deepspeed}
#: the dimensions of the search space no engine's grid can vary, kept to the grid's value under --engine
#: (``autotune.planning.space.SearchSpace``); the rest of a plan is checked by ``check``
GRID_RESTRICTIONS: dict[str, list] = {
    "roundpipe": [False],
    "batch_split": [0.0],
    "stage_ranks": [1],
    "trains_experts": ["all"],
    "sync_every": [1],
    "execution": ["microbatch"],
}


def restrictions(engine: str) -> dict[str, list]:
    """What ``--engine`` narrows in the search space: the grid's and the engine's own (``RESTRICTIONS``)."""
    return {**GRID_RESTRICTIONS, **_engine(engine).RESTRICTIONS}


def restrict(engine: str, choices: Mapping[str, Sequence[Any]], given: Mapping[str, Sequence[Any]]) -> dict:
    """A search space's restriction under ``--engine``: ``given`` (the user's, which win) plus the
    engine's narrowing of each dimension of ``choices`` it leaves a choice in."""
    narrowed = {
        name: allowed
        for name, allowed in restrictions(engine).items()
        if name in choices and name not in given and any(same_choice(c, a) for c in choices[name] for a in allowed)
    }
    return {**narrowed, **given}


__all__ = [
    "ENGINES",
    "EngineGrid",
    "Inexpressible",
    "check",
    "check_name",
    "export",
    "grid",
    "parse",
    "restrict",
    "restrictions",
]


def check_name(engine: str) -> None:
    """A ``SpecError`` line naming the engines unless ``engine`` is one of them."""
    _engine(engine)


def _engine(engine: str) -> ModuleType:
    if engine not in ENGINES:
        from autotune.errors import SpecError, shown

        raise SpecError("--engine", "", f"must be one of {', '.join(ENGINES)}, got {shown(engine)}")
    return ENGINES[engine]


def grid(engine: str, config: ParallelConfig) -> EngineGrid:
    """The plan as ``engine``'s grid; ``Inexpressible`` naming the part the engine cannot run."""
    module = _engine(engine)
    g = grid_of(config, module.NAME)
    reason = module.refusal(g)
    if reason is not None:
        raise Inexpressible(module.NAME, reason)
    return g


def check(engine: str, config: ParallelConfig) -> str | None:
    """None when ``engine`` runs ``config``; else one line naming the part it cannot."""
    try:
        grid(engine, config)
    except Inexpressible as e:
        return e.rule
    return None


def model_check(engine: str, model: ModelSpec) -> str | None:
    """None when ``engine`` trains ``model`` at all (its precision, say); else one line why not."""
    module = _engine(engine)
    return module.model_refusal(model) if hasattr(module, "model_refusal") else None


def export(engine: str, config: ParallelConfig, model: ModelSpec | None = None) -> str:
    """``engine``'s configuration of ``config`` (the model's shape too when given)."""
    if model is not None and (reason := model_check(engine, model)) is not None:
        raise Inexpressible(ENGINES[engine].NAME, reason)
    g = grid(engine, config)
    devices = rank_devices(config, g)
    header = [
        f"{ENGINES[engine].NAME} configuration of the autotune plan {config.describe()}",
        f"{g.world_size} ranks (dp {g.dp} x pp {g.pp} x tp {g.tp}); launch so that rank r runs on device r of:",
        " ".join(devices),
    ]
    return ENGINES[engine].render(g, model, header)


def notes(engine: str, config: ParallelConfig, model: ModelSpec | None = None) -> list[str]:
    """What the user must add by hand beside ``export``'s file (data, tokenizer, iterations, environment
    variables, an mpu), one line each; ``export`` prints them beside the file."""
    module = _engine(engine)
    return list(module.notes(grid(engine, config), model)) if hasattr(module, "notes") else []


def parse(engine: str, text: str) -> EngineGrid:
    return _engine(engine).parse(text)
