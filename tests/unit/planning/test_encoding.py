"""Every plan as a point of the shared space (``SearchSpace.encode``, ``autotune.planning.encoding``): dp's
plans decode back exactly, and one move of a state dimension from them changes exactly that choice."""

from __future__ import annotations

from autotune import load_cluster, load_model
from autotune.evaluator import CachedEvaluator
from autotune.planning import encoding
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.planner import Planner
from autotune.planning.space import SearchSpace
from autotune.simulator import Simulator
from autotune.specs import Measurement


def _dp_plans(cluster="mixed-a100-v100", model="gpt2-xl", n=6):
    cluster, model = load_cluster(cluster), load_model(model)
    space = SearchSpace(cluster, model)
    return space, [c.config for c in Planner(space, Simulator(cluster, model)).plan(n)]


def _differences(a, b) -> set[str]:
    """Which plan fields differ between ``a`` and ``b`` (stage fields by name)."""
    out = {
        f
        for f in ("micro_batch_size", "schedule", "virtual_stages", "zero", "sync_every_steps")
        if getattr(a, f) != getattr(b, f)
    }
    for pa, pb in zip(a.pipelines, b.pipelines):
        if pa.num_microbatches != pb.num_microbatches:
            out.add("num_microbatches")
        if pa.execution != pb.execution:
            out.add("execution")
        for sa, sb in zip(pa.stages, pb.stages):
            out |= {
                f
                for f in ("devices", "layers", "recompute", "offload", "sequence_parallel")
                if getattr(sa, f) != getattr(sb, f)
            }
    if len(a.pipelines) != len(b.pipelines) or any(
        len(x.stages) != len(y.stages) for x, y in zip(a.pipelines, b.pipelines)
    ):
        out.add("structure")
    return out


#: the plan fields one move of each state dimension may change
CHANGES = {
    "mbs": {"micro_batch_size", "num_microbatches"},
    "schedule": {"schedule", "virtual_stages"},
    "recompute": {"recompute"},
    "seq_parallel": {"sequence_parallel"},
    "zero": {"zero"},
    "offload": {"offload"},
    "execution": {"execution"},
}


def test_dp_plans_decode_back_exactly_and_their_nearest_point_alone_does_not():
    space, plans = _dp_plans()
    differ = 0
    for config in plans:
        params = space.encode(config)
        assert set(params) == {d.name for d in space.dimensions} | {encoding.ANCHOR}
        assert space.decode(params).config == config
        alone = {k: v for k, v in params.items() if k != encoding.ANCHOR}
        differ += space.decode(alone).config != config
    assert differ > 0  # what the anchor is for: the planner's splits are not the exponents'


def test_one_move_of_a_state_dimension_from_a_dp_plan_changes_exactly_that_choice():
    space, plans = _dp_plans()
    moved = set()
    for config in plans:
        params = space.encode(config)
        for name, fields in CHANGES.items():
            if name not in space._dims:
                continue
            choices = space._dims[name].choices
            i = choices.index(params[name])
            for j in (i - 1, i + 1):
                if not 0 <= j < len(choices):
                    continue
                decoded = space.decode(dict(params, **{name: choices[j]}))
                if not decoded.ok:
                    continue
                diff = _differences(config, decoded.config)
                # nothing else changes (the same plan where the choice makes no difference, as decode has it:
                # layer-wise execution without ZeRO-2/3 or offload)
                assert diff <= fields, (name, choices[j], diff)
                if diff:
                    moved.add(name)
    assert {"mbs", "schedule", "recompute", "zero", "offload", "execution"} <= moved


def test_a_structural_move_or_an_unknown_anchor_decodes_the_point_as_any_other():
    space, plans = _dp_plans()
    params = space.encode(plans[0])
    pp = space._dims["pp"].choices
    other = dict(params, pp=pp[pp.index(params["pp"]) - 1] if params["pp"] != pp[0] else pp[1])
    plain = {k: v for k, v in other.items() if k != encoding.ANCHOR}
    assert space.decode(other) == space.decode(plain)
    unknown = dict(params, **{encoding.ANCHOR: "000000000000"})
    assert space.decode(unknown) == space.decode({k: v for k, v in params.items() if k != encoding.ANCHOR})


def test_an_env_episode_from_dp_s_plan_edits_that_plan():
    from envs.parallel_config import ParallelConfigEnv

    space, plans = _dp_plans()
    cluster, model = space.cluster, space.model
    evaluator = BudgetedEvaluator(CachedEvaluator(Simulator(cluster, model)), space, budget=50)
    config = plans[0]
    m = evaluator.evaluate(config, space.encode(config))
    env = ParallelConfigEnv(space, evaluator)
    env.reset(seed=0, options={"params": space.encode(config)})
    assert env.config == config
    cands = env._get_candidates()
    zero_up = next(i for i, a in enumerate(env.actions) if a == ("dim", "zero", 1))
    assert cands[zero_up] is not None
    assert _differences(config, cands[zero_up][0]) == {"zero"}
    assert isinstance(m, Measurement)
