"""``elaunch timeline`` draws the goodput ledger: productive and lost time in different colours (pure logic)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from elaunch.agent.ledger import ledger_of
from elaunch.timeline.model import LEDGER, build
from elaunch.timeline.svg import render_svg

SVG = "{http://www.w3.org/2000/svg}"


def ev(t, kind, node="a", **fields):
    return {"time": 1000.0 + t, "kind": kind, "node": node, "host": "h", "round": 0, **fields}


def job(node="a", crash=10.0):
    return [ev(0, "rendezvous_join", node), ev(1, "rendezvous_complete", node),
            ev(2, "workers_started", node, local_ranks=[0], ranks=[0], pids=[7]),
            ev(3, "training", node, step=0),
            # written after the group ended, with the exit's earlier time
            ev(crash + 0.5, "restart", node, counted=True, count=1, budget=1, step=40),
            ev(crash, "worker_exited", node, rank=0, local_rank=0, pid=7, exitcode=1, stopped=False, step=40),
            ev(crash + 1, "rendezvous_join", node), ev(crash + 2, "rendezvous_complete", node),
            ev(crash + 3, "workers_started", node, local_ranks=[0], ranks=[0], pids=[8]),
            ev(crash + 4, "training", node, step=30), ev(crash + 6, "caught_up", node, step=40),
            ev(crash + 9, "worker_exited", node, rank=0, local_rank=0, pid=8, exitcode=0, stopped=False, step=50),
            ev(crash + 9, "job_succeeded", node, restarts=1)]


def test_lanes_carry_the_ledger_of_their_node_in_the_order_written():
    events = job("a") + job("b", crash=5.0)
    tl = build(events)
    lanes = {lane.node: lane for lane in tl.lanes}
    a = lanes["a"]
    assert [c for c, _, _ in a.ledger] == ["rendezvous", "starting", "productive", "stopped", "rendezvous",
                                           "starting", "restoring", "productive"]
    assert a.ledger[0][1] == 0.0 and a.ledger[-1][2] == pytest.approx(19.0)  # seconds after the first event
    assert a.seconds == pytest.approx(ledger_of(job("a"))["seconds"])  # the restart line came first: stopped at 10.5
    assert a.goodput == pytest.approx(ledger_of(job("a"))["goodput"])
    assert tl.goodput == pytest.approx(ledger_of(events)["goodput"])
    assert 0 < lanes["b"].goodput < a.goodput  # b lost the same time out of a shorter run


def test_svg_draws_each_category_in_its_colour_with_the_goodput():
    root = ET.fromstring(render_svg(build(job())))
    rects = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    ledger = {r.get("fill"): r.find(f"{SVG}title").text for r in rects if r.find(f"{SVG}title").text.startswith(
        tuple(label for label, _ in LEDGER.values()))}
    colours = {cat: colour for cat, (_, colour) in LEDGER.items()}
    assert set(ledger) == {colours[c] for c in ("productive", "rendezvous", "starting", "restoring", "stopped")}
    assert ledger[colours["restoring"]].startswith("lost: restoring (redoing lost steps) 14.00-16.00 s")
    assert len(set(colours.values())) == len(colours)  # productive and every kind of lost time differ
    texts = [t.text for t in root.iter(f"{SVG}text")]
    share = ledger_of(job())["goodput"]
    assert f"goodput {share:.1%}" in texts
    assert any(t.startswith("ledger: productive") for t in texts)  # the legend


def test_a_log_without_ledger_events_still_draws():
    tl = build([ev(0, "rendezvous_join"), ev(1, "notice", signal="SIGUSR1")])
    assert tl.lanes[0].ledger == [("rendezvous", 0.0, 1.0)] and tl.lanes[0].goodput == 0.0
    assert "<svg" in render_svg(tl)


def test_a_survivor_of_an_in_process_restart_is_one_bar_and_the_restart_a_mark():
    events = [ev(0, "rendezvous_join"), ev(1, "rendezvous_complete"),
              ev(2, "workers_started", local_ranks=[0, 1], ranks=[0, 1], pids=[7, 8]),
              ev(5, "worker_exited", rank=1, local_rank=1, pid=8, exitcode=-9, signal="SIGKILL", stopped=False),
              ev(5.1, "restart", counted=True, count=1, budget=1),
              ev(5.2, "inprocess_restart", kept=[0], started=[1], seconds=0.2),
              ev(5.2, "workers_started", local_ranks=[0, 1], ranks=[0, 1], pids=[7, 9]),
              ev(9, "worker_exited", rank=0, local_rank=0, pid=7, exitcode=0, stopped=False),
              ev(9, "worker_exited", rank=1, local_rank=1, pid=9, exitcode=0, stopped=False),
              ev(9, "job_succeeded", restarts=1)]
    (lane,) = build(events).lanes
    rank0 = [(state, round(t1 - t0, 1)) for state, t0, t1, _, lr in lane.spans
             if lr == 0 and state.startswith("worker")]
    assert rank0 == [("worker_ok", 7.0)]  # pid 7 ran from the first start to the end
    assert [m for m in lane.marks if m[0] == "inprocess"]
    render_svg(build(events))  # the mark has a legend entry and a shape
