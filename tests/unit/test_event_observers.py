"""EventLog.add_observer: observers get the dict written to events.jsonl, file or not, and never break the agent."""

from __future__ import annotations

import json
import logging

from elaunch.agent.events import EventLog


def test_observers_get_the_dict_that_is_written(tmp_path):
    path = tmp_path / "events.jsonl"
    seen: list[dict] = []
    ev = EventLog(str(path), "n1", "h", clock=lambda: 7.0)
    ev.add_observer(seen.append)
    ev.emit("a", x=1)
    ev.emit("b", round=2, at=6.5, y=[1, 2])
    ev.close()
    ev.emit("after_close")
    assert seen == [json.loads(line) for line in path.read_text().splitlines()]
    assert [d["kind"] for d in seen] == ["a", "b"]


def test_observers_get_events_without_a_file():
    seen: list[dict] = []
    ev = EventLog(None, "n", "h", clock=lambda: 1.0)
    ev.add_observer(seen.append)
    ev.emit("a")
    assert seen == [{"time": 1.0, "kind": "a", "node": "n", "host": "h", "round": -1}]


def test_a_failing_observer_is_dropped_with_one_warning_and_the_others_go_on(tmp_path, caplog):
    seen: list[str] = []

    def broken(doc: dict) -> None:
        raise RuntimeError("boom")

    ev = EventLog(str(tmp_path / "events.jsonl"), "n", "h")
    ev.add_observer(broken)
    ev.add_observer(lambda doc: seen.append(doc["kind"]))
    with caplog.at_level(logging.WARNING, logger="elaunch.agent"):
        ev.emit("a")
        ev.emit("b")
    assert seen == ["a", "b"]
    assert len([r for r in caplog.records if "event observer" in r.getMessage()]) == 1
    assert len((tmp_path / "events.jsonl").read_text().splitlines()) == 2


def test_two_threads_emitting_observers_see_the_files_order(tmp_path):
    # the main thread and the straggler watch's thread both emit; an observer that yields the GIL
    # mid-event would see another order than the file's without the log's lock
    import threading
    import time

    path = tmp_path / "events.jsonl"
    seen: list[str] = []
    ev = EventLog(str(path), "n", "h")
    ev.add_observer(lambda doc: (time.sleep(0), seen.append(f"{doc['kind']}{doc['i']}")))

    def emit_many(kind: str) -> None:
        for i in range(300):
            ev.emit(kind, i=i)

    threads = [threading.Thread(target=emit_many, args=(k,)) for k in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ev.close()
    written = [(lambda d: f"{d['kind']}{d['i']}")(json.loads(line)) for line in path.read_text().splitlines()]
    assert len(written) == 600 and seen == written
