"""What a goodput run's output says: group starts, steps lost, the table and the report scenario.

Pure functions over what :mod:`benchmarks.goodput_hosts` collected (the agents' output
lines with the time each was seen, the workers' step counters), so they are tested
with tables, no processes.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.goodput_hosts import Worker

TRAIN_SAMPLES = 1437  #: ddp_digits' training split (load_digits, 80 %)
BATCH = 32  #: ddp_digits' default --batch-size
#: rank 0's line on a resume: ``resumed from SOURCE at epoch E step S`` or ``... after epoch E``
RESUMED = re.compile(r"resumed from (.+?) (?:at epoch (\d+) step (\d+)|after epoch (\d+))\s*$")
#: A report target the elaunch median must reach (benchmarks/report.py ``abs_ge``).
TARGET = {"kind": "abs_ge", "value": 95.0, "text": ">= 95 %"}
#: Issue 37's targets for in-process restart (configuration d), by fault.
TARGET_IN_PROCESS = {"kill": {"kind": "abs_ge", "value": 99.0, "text": ">= 99 %"},
                     "node": {"kind": "abs_ge", "value": 97.0, "text": ">= 97 %"}}


def steps_per_epoch(world: int) -> int:
    """Steps of one epoch at ``world`` ranks (DistributedSampler pads to ceil(N / world), batches of 32)."""
    return -(-(-(-TRAIN_SAMPLES // world)) // BATCH)


def classify(source: str) -> str:
    """``snapshot`` for ``snapshot of step N`` (ckpt.load), else ``disk`` (the --checkpoint file)."""
    return "snapshot" if source.startswith("snapshot") else "disk"


def attempts(lines: Sequence[tuple[float, int, str]], workers: Sequence[Worker], t_start: float) -> list[dict]:
    """One entry per group start (a rank 0 process), oldest first.

    Args:
        lines: (time seen, host, line) of the agents' output; a ``resumed from`` line
            belongs to the rank 0 that started last before it was seen.
        workers: every worker's step counter.
        t_start: when the run started (time.time(), s).

    Returns:
        Dicts: ``world``; ``start`` and ``first`` (its first step; None: none) in s after
        ``t_start``; ``from`` (``start`` for the
        first group, ``snapshot``/``disk`` when it resumed, ``scratch`` for a later group
        that trained without resuming, ``none`` for one that failed before its first step:
        it carries the last group's position); ``done`` (epochs complete, steps of the next); ``position`` (its
        first step); ``started`` (steps it started); ``reached`` (position + started);
        and, for all but the last, ``lost``: reached minus where the next group resumed,
        in steps of this group's world (a world change restarts the epoch).
    """
    resumed = []
    for t, _host, line in lines:
        m = RESUMED.search(line)
        if m:
            done = (int(m[2]) - 1, int(m[3])) if m[2] else (int(m[4]), 0)
            resumed.append((t, m[1], done))
    zeros = [w for w in workers if w.rank == 0]
    out: list[dict] = []
    for k, z in enumerate(zeros):
        until = zeros[k + 1].start if k + 1 < len(zeros) else float("inf")
        hit = next((r for r in resumed if z.start <= r[0] < until), None)
        entry = {"world": z.world, "start": round(z.start - t_start, 2),
                 "first": round(z.first - t_start, 2) if z.first else None,
                 "source": hit[1] if hit else None, "started": z.count}
        if hit is None and k and not z.count:  # failed before its first step: where it stood is the last group's
            prev = out[-1]
            entry.update({"from": "none", "world": prev["world"], "done": prev["done"],
                          "position": prev["reached"], "reached": prev["reached"]})
        else:
            done = hit[2] if hit else (0, 0)
            pos = done[0] * steps_per_epoch(z.world) + done[1]
            entry.update({"from": classify(hit[1]) if hit else ("scratch" if k else "start"), "done": done,
                          "position": pos, "reached": pos + z.count})
        out.append(entry)
    for prev, nxt in zip(out, out[1:]):
        prev["lost"] = 0 if nxt["from"] == "none" else \
            prev["reached"] - (nxt["done"][0] * steps_per_epoch(prev["world"]) + nxt["done"][1])
    return out


def summarize(row: dict, final: dict | None, ref: dict | None) -> None:
    """Fill ``row``'s restarts, steps lost, restores by source, worlds, recoveries and digest check.

    ``row`` holds ``attempts`` (:func:`attempts`), ``events`` (each fault, ``t`` in s after
    the run's start) and ``note``; ``ref`` is the uninterrupted run's row.
    """
    tries = row["attempts"]
    row["restarts"] = max(0, len(tries) - 1)
    row["steps_lost"] = sum(a.get("lost", 0) for a in tries)
    row["restores"] = {k: sum(1 for a in tries if a["from"] == k) for k in ("snapshot", "disk", "scratch", "none")}
    row["worlds"] = [a["world"] for a in tries]
    # a fault's recovery: from the fault to the first step of the first group started after it
    row["recovery_s"] = []
    for event in row["events"]:
        nxt = next((a for a in tries if a["start"] > event["t"] and a["first"] is not None), None)
        if nxt:
            row["recovery_s"].append(round(nxt["first"] - event["t"], 2))
    row["final"] = final
    row["bit_identical"] = None
    if final and ref and ref.get("final"):
        row["bit_identical"] = final["sha256"] == ref["final"]["sha256"]
        if len(set(row["worlds"])) > 1 and not row["bit_identical"]:
            worlds = " -> ".join(str(w) for w in dict.fromkeys(row["worlds"]))
            note = f"world size changed ({worlds}): the parameters differ by design"
            row["note"] = f"{row['note']}; {note}" if row["note"] else note


def fmt_s(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f} s"


#: Steps after a fault over which :func:`in_run` reads its cost (fewer when the next fault or the run's end comes first).
WINDOW = 40


def read_steps(counters: Path) -> list[tuple[float, int, int]]:
    """Every worker's ``(time, step, world size)`` records: the ``steps-*`` files the goodput worker appends to at
    each step's start (``benchmarks/workers/goodput_worker.py``); a line cut by a kill is skipped."""
    found = []
    for path in sorted(counters.glob("steps-*")):
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            try:
                found.append((float(parts[0]), int(parts[1]), int(parts[2])))
            except (IndexError, ValueError):
                continue
    return found


def in_run(records: Sequence[tuple[float, int, int]], fault_times: Sequence[float], T_s: float | None,
           window: int = WINDOW) -> dict:
    """Each fault's cost read from the faulty run's own steps, and the goodput that implies.

    T0 / T compares two runs, and on this shared machine two runs differ by seconds in their
    start-up and by a few percent in their step time (machine speed): more than a node
    replacement costs. Read from one run, the cost needs neither.

    ``F[s]``: the last start of step ``s`` by any worker (the start that counted: a step redone
    after a fault counts its redo). The step time is the median of ``F[s + 1] - F[s]``. For a
    fault at time ``k``: ``a``, the last step with ``F[a] < k``; ``b``, ``window`` steps later, or
    fewer when the next fault or the run's end comes first; the cost is ``F[b] - F[a] - (b - a)``
    step times: the restart, the work lost since ``a`` (redone steps), and any slower step after
    it (a replacement's first saves). None when a step from ``a`` to ``b`` ran at another world
    size than ``a`` (the example numbers steps by its world's epochs) or no step follows.

    Args:
        records: ``(time, step, world size)`` of every worker (:func:`read_steps`); times in seconds
            since the epoch.
        fault_times: when each fault was injected, same clock, in order.
        T_s: the faulty run's length (launch to the last exit), or None (it did not complete).

    Returns:
        ``step_s``, ``fault_costs_s`` (one per fault, seconds or None), and ``goodput_in_run``:
        ``1 - sum(costs) / T_s``, the T0 / T of an uninterrupted run as long as this one less its
        faults' costs (None when a cost or ``T_s`` is None).
    """
    last: dict[int, tuple[float, int]] = {}
    for t, step, world in records:
        if step not in last or t > last[step][0]:
            last[step] = (t, world)
    gaps = [last[s + 1][0] - last[s][0] for s in last if s + 1 in last and last[s + 1][1] == last[s][1]]
    step_s = statistics.median(gaps) if gaps else None
    costs: list[float | None] = []
    for i, k in enumerate(fault_times):
        until = fault_times[i + 1] if i + 1 < len(fault_times) else float("inf")
        before = [s for s, (t, _w) in last.items() if t < k]
        if not before or step_s is None:
            costs.append(None)
            continue
        a = b = max(before)
        while b + 1 in last and b + 1 - a <= window and last[b + 1][0] < until:
            b += 1
        same = all(last[s][1] == last[a][1] for s in range(a, b + 1))
        costs.append(round(last[b][0] - last[a][0] - (b - a) * step_s, 3) if b > a and same else None)
    whole = bool(T_s) and bool(costs) and all(c is not None for c in costs)
    return {"step_s": None if step_s is None else round(step_s, 4), "fault_costs_s": costs,
            "goodput_in_run": (1 - sum(costs) / T_s) if whole else None}


def bracket_t0(rows: Sequence[dict], way: Callable[[dict], object]) -> None:
    """Give each faulty row the T0 of the uninterrupted runs beside it, in place: ``T0_s``, the mean of the
    nearest uninterrupted run of the same way (``way(row)``: a configuration, or in process or not) before
    it and the nearest after it in ``rows``' order (the run order), or of the one that exists;
    ``T0_runs_s``, those runs' lengths; ``goodput``, ``T0_s / T_s`` (None where either is None).

    The machine's speed drifts by several percent within minutes here (an uninterrupted FSDP2 run took
    131.7 s and, 12 minutes later, 102.8 s), and T0 / T counts that drift as the faults'; a faulty run
    between two uninterrupted runs (``--interleave``) is compared with the machine of its own minutes.
    An uninterrupted row whose ``T_s`` is None (it did not complete) is skipped; a faulty row with no
    uninterrupted run of its way keeps its fields.
    """
    for i, row in enumerate(rows):
        if row["fault"] == "none":
            continue
        same = [j for j, r in enumerate(rows) if r["fault"] == "none" and r.get("T_s") is not None
                and way(r) == way(row)]
        near = [j for j in (max((j for j in same if j < i), default=None),
                            min((j for j in same if j > i), default=None)) if j is not None]
        if not near:
            continue
        row["T0_runs_s"] = [rows[j]["T_s"] for j in near]
        row["T0_s"] = statistics.fmean(row["T0_runs_s"])
        row["goodput"] = row["T0_s"] / row["T_s"] if row.get("T_s") else None


def markdown(rows: Sequence[dict]) -> str:
    """The rows as a markdown table (one per configuration and fault)."""
    lines = ["| config | fault | T0 | T faulty | goodput | in-run estimate | restarts | steps lost | restored from | "
             "fault -> training (median) | bit-identical | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gp = "—" if r["goodput"] is None else f"{100 * r['goodput']:.1f} %"
        est = r.get("goodput_in_run")
        est = "—" if est is None else f"{100 * est:.1f} % ({', '.join(fmt_s(c) for c in r['fault_costs_s'])})"
        src = ", ".join(f"{k} {v}" for k, v in r["restores"].items() if v) or "—"
        same = {None: "—", True: "yes", False: "no"}[r["bit_identical"]]
        back = fmt_s(statistics.median(r["recovery_s"])) if r["recovery_s"] else "—"
        lines.append(f"| {r['config']}: {r['label']} | {r['fault_label']} | {fmt_s(r['T0_s'])} | "
                     f"{fmt_s(r['T_s'])} | {gp} | {est} | {r['restarts']} | {r['steps_lost']} | {src} | {back} | {same} | "
                     f"{r['note']} |")
    return "\n".join(lines) + "\n"


def _metric(key: str, label: str, unit: str, e: Sequence[dict], t: Sequence[dict], field: str,
            target: dict | None = None) -> dict:
    """A benchmarks.report metric: elaunch's rows ``e`` against torchrun's ``t`` (``field`` of each; the median
    of the runs that read it; ``--interleave`` gives a fault several runs)."""
    values, notes, median = {}, {}, {}
    for which, runs in (("elaunch", e), ("torchrun", t)):
        vals = [row.get(field) for row in runs]
        vals = [None if v is None else 100.0 * v if unit == "%" else float(v) for v in vals]
        read = [v for v in vals if v is not None]
        values[which] = vals or [None]
        median[which] = statistics.median(read) if read else None
        notes[which] = [(row["note"] or "did not complete") for row, v in zip(runs, vals) if v is None] \
            if runs else ["not run"]
    ratio = median["elaunch"] / median["torchrun"] if median["elaunch"] is not None and median["torchrun"] else None
    return {"key": key, "label": label, "unit": unit, "values": values, "notes": notes, "target": target,
            "median": median, "ratio": ratio}


def report_scenario(rows: Sequence[dict], state_mib: int) -> dict:
    """The ``goodput`` scenario for benchmarks/report.py: elaunch a and b each against torchrun c."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["config"], r["fault"]), []).append(r)
    what = f"3 hosts, {state_mib} MiB state"
    metrics = []
    for fault in dict.fromkeys(r["fault"] for r in rows if r["fault"] in ("kill", "node")):
        label = next(r["fault_label"] for r in rows if r["fault"] == fault)
        for cfg, how, target in (("a", "ckpt.save every step", TARGET), ("b", "per-epoch torch.save", None),
                                 ("d", "in process, ckpt.save every step", TARGET_IN_PROCESS.get(fault))):
            if (cfg, fault) in by:
                vs = f"({what}): elaunch {how} vs torchrun per-epoch torch.save"
                metrics.append(_metric(f"goodput.{fault}_{cfg}", f"goodput, {label} {vs}", "%", by[(cfg, fault)],
                                       by.get(("c", fault), []), "goodput", target))
                metrics.append(_metric(f"goodput.{fault}_{cfg}_lost", f"steps lost, {label} {vs}", "steps",
                                       by[(cfg, fault)], by.get(("c", fault), []), "steps_lost"))
    lost = next((r for r in rows if r["fault"] == "lost"), None)
    if lost:
        kills = [e for e in lost["events"] if e["fault"] == "worker SIGKILL"]
        torn = sum(1 for e in kills if e.get("during_save"))
        raises = sum(1 for e in lost["events"] if e["fault"] == "worker raise")
        also = f", {raises} rank(s) raising" if raises else ""
        m = _metric("goodput.nothing_lost", f"nothing lost: {len(kills)} worker SIGKILLs ({torn} during a save), "
                    f"a node replaced{also}, final parameters bit-identical ({what}, {lost['label']})", "bool",
                    [lost], [], "bit_identical")
        m["notes"]["torchrun"] = ["not run (a check of elaunch's ckpt.save)"]
        metrics.append(m)
    return {"name": "goodput", "metrics": metrics}
