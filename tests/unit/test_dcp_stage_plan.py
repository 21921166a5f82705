"""SnapshotWriter.stage's planner: DCP's default local save plan, kept while the state's signature holds.

The plan is taken again only while every leaf keeps its fqn, shape, dtype and requires_grad
(and, for a DTensor, its local shape, mesh and placements); a changed shape, a new key or a
leaf that became a tensor is planned anew, with DCP's own items for it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.checkpoint import DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan  # noqa: E402

from elaunch.checkpoint import dcp as edcp  # noqa: E402


def plan_of(state):
    planner = edcp._StagePlanner()
    planner.set_up_planner(state, None, False)
    plan, layout = planner.local_plan()
    return plan, layout, planner


def flat(state):
    """``state`` flattened as DCP's default planner flattens it (its fqns)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, False)
    return planner.state_dict


def keys(plan):
    return [(i.index.fqn, tuple(i.index.offset) if i.index.offset is not None else None,
             tuple(i.tensor_data.size) if i.tensor_data else None) for i in plan.items]


@pytest.mark.parametrize("changed", [
    {"a": torch.zeros(5), "n": 1},                     # a shape
    {"a": torch.zeros(4, dtype=torch.float64), "n": 1},  # a dtype
    {"a": torch.zeros(4), "n": torch.ones(2)},         # a value became a tensor
    {"a": torch.zeros(4), "n": 1, "m": {"x": 2}},      # a new key
])
def test_the_plan_is_kept_while_the_state_keeps_its_structure_and_made_again_when_it_changes(changed):
    edcp._StagePlanner._last = None
    first, _, _ = plan_of({"a": torch.zeros(4), "n": 1})
    again, _, planner = plan_of({"a": torch.ones(4), "n": 2})
    assert again is first  # the same structure: DCP's plan is not made again
    assert torch.equal(planner.resolve_data(again.items[[i.index.fqn for i in again.items].index("a")]),
                       torch.ones(4))  # the data is this state's
    got, layout, _ = plan_of(changed)
    assert got is not first
    want = create_default_local_save_plan(flat(changed), False)
    assert sorted(keys(got)) == sorted(keys(want))
    assert set(layout["fqns"]) == {i.index.fqn for i in want.items}
