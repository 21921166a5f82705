"""``elaunch status``: the click command over :mod:`elaunch.status.read` and :mod:`elaunch.status.report`.

Same spellings as the main command for the rendezvous flags (``--rdzv-backend``,
``--rdzv-endpoint``, ``--rdzv-id``, ``--rdzv-conf``, their underscore aliases and
``PET_*`` fallbacks), so a job's own flags can be pasted. Exit status: 0 the job
was read (and with ``--stacks``, every node answered); 1 it could not be read
(unreachable endpoint, no such run id) or a node did not answer; 2 bad input.
Every error is one line on stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import click

from elaunch.cli import PetOption
from elaunch.cli import params as P
from elaunch.config import EXIT_USAGE, ConfigError
from elaunch.rendezvous.contract import RendezvousConfigError

#: Default seconds ``--stacks`` waits for the agents' answers (a dump takes up to ~20 s per node).
STACKS_TIMEOUT = 30.0
EXIT_UNREADABLE = 1


def _opt(*decls: str, **attrs: Any):
    return click.option(*decls, cls=PetOption, group="Rendezvous", **attrs)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@_opt("--rdzv-backend", "--rdzv_backend", "rdzv_backend", type=P.PARSED, default="c10d", metavar="BACKEND",
      help="The job's rendezvous backend: c10d, etcd, etcd-v2 or etcd-v3.")
@_opt("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", default="", metavar="HOST[:PORT]",
      help="The job's rendezvous endpoint (c10d: the store, default port 29400; etcd: a comma-separated list).")
@_opt("--rdzv-id", "--rdzv_id", "rdzv_id", default="none", metavar="ID", help="The job's id.")
@_opt("--rdzv-conf", "--rdzv_conf", "rdzv_conf", type=P.PARSED, default="", metavar="K=V,...",
      help="The job's backend options; read_timeout (seconds, default 10 here) bounds every read.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (schema: docs/status.md).")
@click.option("--stacks", is_flag=True,
              help="Ask every agent to dump its workers' Python stacks; print identical stacks once with "
                   "the ranks that share them. The job keeps running unchanged.")
@click.option("--stacks-timeout", type=click.FloatRange(min=0, min_open=True), default=STACKS_TIMEOUT,
              show_default=True, metavar="SECONDS", help="Seconds --stacks waits for the agents' answers.")
def command(rdzv_backend: str, rdzv_endpoint: str, rdzv_id: str, rdzv_conf: dict, as_json: bool,
            stacks: bool, stacks_timeout: float) -> int:
    """Show a running (or finished) job's rendezvous without joining it."""
    from elaunch.status import goodput, read, report

    if rdzv_backend not in read.BACKENDS:
        raise ConfigError(f"--rdzv-backend={rdzv_backend}: elaunch status reads {', '.join(read.BACKENDS)} "
                          "(the static rendezvous keeps no shared state)")
    if not rdzv_endpoint.strip():
        raise ConfigError("--rdzv-endpoint: required (the job's rendezvous endpoint)")
    reader = read.open_reader(rdzv_backend, rdzv_endpoint, rdzv_id or "none", rdzv_conf)
    try:
        snap = read.snapshot(reader)
        doc = report.build(snap.state, snap.agents, backend=rdzv_backend, endpoint=reader.endpoint,
                           run_id=reader.run_id, now=snap.read_at, dead_after=reader.settings.dead_after,
                           checkpoints=snap.checkpoints, node_checks=snap.node_checks, stragglers=snap.stragglers)
        goodput.add_goodput(doc)  # from each node's events.jsonl where it can be read here
        status = 0
        answer = None
        if stacks:
            if doc["state"] != report.RUNNING:
                raise read.StatusError(f"rendezvous {reader.run_id!r} round {snap.state.round} is {doc['state']}, "
                                       "not running: no workers to ask for stacks")
            answer = read.request_stacks(reader, sorted(snap.state.participants), stacks_timeout)
            doc["stacks"] = {"dump_id": answer.dump_id, "groups": report.group_stacks(answer.docs),
                             "missing": answer.missing,
                             "files": {n: d.get("path") for n, d in sorted(answer.docs.items())}}
            status = EXIT_UNREADABLE if answer.missing else 0
    finally:
        reader.close()
    if as_json:
        click.echo(json.dumps(doc, sort_keys=True))
    else:
        click.echo(report.table(doc))
        if answer is not None:
            click.echo(report.stacks_text(doc["stacks"]["groups"], answer.missing))
    return status


def main(argv: Sequence[str]) -> int:
    """Run ``elaunch status`` with ``argv`` (after the word ``status``); return the exit status.

    Returns:
        0, 1 (could not read the job, or a node sent no stacks) or 2 (bad input); errors are one line on stderr.
    """
    from elaunch.status.read import StatusError

    try:
        with command.make_context("elaunch status", list(argv)) as ctx:
            return int(command.invoke(ctx) or 0)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.UsageError as exc:
        return _line(f"error: {exc.format_message()}", EXIT_USAGE)
    except (ConfigError, RendezvousConfigError) as exc:
        return _line(f"error: {exc}", EXIT_USAGE)
    except StatusError as exc:
        return _line(str(exc), EXIT_UNREADABLE)


def _line(message: str, status: int) -> int:
    click.echo("elaunch status: " + " ".join(str(message).split()), err=True)
    return status


def run() -> None:
    """``python -m elaunch.status``: run and exit (skipping torch's teardown, as the main command)."""
    from elaunch.log import fast_exit

    fast_exit(main(sys.argv[1:]))
