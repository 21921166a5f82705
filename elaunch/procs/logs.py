"""Where workers' output goes: the log-directory layout and per-attempt destinations.

Mirrors torch's ``DefaultLogsSpecs``: the run directory is
``<log_dir>/<run_id>_<random>/``, one ``attempt_<n>/`` per started group and in it
one ``<local_rank>/`` per worker holding ``stdout.log``, ``stderr.log`` (when
redirected or tee'd) and ``error.json`` (the worker's ``TORCHELASTIC_ERROR_FILE``).
``log_dir=os.devnull`` makes no files at all, as torch's ``DefaultLogsSpecs.reify``:
every stream goes to the console unprefixed, whatever ``--redirects``, ``--tee`` and
``--local-ranks-filter`` say, and the workers' ``TORCHELASTIC_ERROR_FILE`` is empty.

With ``--logs-specs NAME`` naming a ``torchrun.logs_specs`` entry point other than
torch's ``DefaultLogsSpecs``, :class:`SpecsLogDir` lets that torch ``LogsSpecs``
decide the files instead, from its ``reify(envs)`` as torch's agent does.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from string import Template
from typing import Any

from .std import Std, std_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogsSpec:
    """What to do with workers' stdout/stderr (``--log-dir``, ``--redirects``, ``--tee``, ...).

    Attributes:
        log_dir: base directory (``--log-dir``); None -> a fresh
            ``tempfile.mkdtemp(prefix="torchelastic_")`` as torch does; ``os.devnull``
            -> no files, every stream on the console (``redirects``, ``tee`` and
            ``local_ranks_filter`` have no effect then, as in torch).
        redirects: streams written to the rank's log file instead of the console.
        tee: streams written to the log file AND to the console, each line prefixed.
        local_ranks_filter: ``--local-ranks-filter``: only these local ranks reach
            the console (others still get their files); None or empty: all ranks.
        line_prefix_template: ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` with
            ``$role_name``, ``$rank``, ``$local_rank``; None -> ``[<role><local_rank>]:``.
        capture_stderr: keep every worker's stderr in its ``stderr.log`` even when it
            goes to the console (copied there unprefixed), so a failure summary can
            show its last lines. An elaunch addition; torchrun keeps no such file.
        specs: a torch ``LogsSpecs`` instance (``--logs-specs``) whose ``reify``
            decides every file, or None for elaunch's layout above (then
            ``log_dir``, ``redirects``, ``tee`` and ``local_ranks_filter`` apply).
    """

    log_dir: str | None = None
    redirects: "Std | dict[int, Std]" = Std.NONE
    tee: "Std | dict[int, Std]" = Std.NONE
    local_ranks_filter: frozenset[int] | None = None
    line_prefix_template: str | None = None
    capture_stderr: bool = True
    specs: Any = field(default=None, compare=False)

    def shows_on_console(self, local_rank: int) -> bool:
        """Return False when ``--local-ranks-filter`` hides ``local_rank``'s output."""
        return not self.local_ranks_filter or local_rank in self.local_ranks_filter


def line_prefix(template: str | None, role: str, rank: int, local_rank: int) -> str:
    """Return the console prefix of a worker's tee'd lines, as torchrun builds it.

    Args:
        template: ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` or None for ``[<role><local_rank>]:``.
        role: the workers' role name; rank: global rank; local_rank: local rank.
    """
    if template:
        return Template(template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank)
    return f"[{role}{local_rank}]:"


@dataclass
class AttemptLogs:
    """Destinations of one started group (one attempt), per local rank.

    Attributes:
        dir: the ``attempt_<n>`` directory (``os.devnull`` when ``log_dir`` is ``os.devnull``).
        stdout, stderr: file the stream is written to; None = the agent's own console
            (inherited); ``os.devnull`` when hidden by ``--local-ranks-filter``.
        tee_stdout, tee_stderr: for ranks whose file is also copied to the console:
            the file to follow (subset of ``stdout``/``stderr`` values).
        unprefixed: local ranks whose stderr is copied to the console without a
            prefix (captured for the failure summary, not tee'd by the user).
        error_file: each worker's ``TORCHELASTIC_ERROR_FILE`` ("" when discarded).
    """

    dir: str
    stdout: dict[int, str | None] = field(default_factory=dict)
    stderr: dict[int, str | None] = field(default_factory=dict)
    tee_stdout: dict[int, str] = field(default_factory=dict)
    tee_stderr: dict[int, str] = field(default_factory=dict)
    unprefixed: set[int] = field(default_factory=set)
    error_file: dict[int, str] = field(default_factory=dict)


def log_dir_problem(log_dir: str | None) -> str | None:
    """Say why ``--log-dir`` cannot hold a run's log directory, or None when it can.

    Makes and removes an empty directory in it, as the run's own will be made there; for
    a missing ``log_dir``, in its nearest existing ancestor (``log_dir`` itself is made
    only by the run, as torch's ``DefaultLogsSpecs`` makes it: a launch that fails another
    check leaves nothing behind). Called before the rendezvous, so a bad ``--log-dir`` is
    reported before any worker or helper starts.

    Args:
        log_dir: the base directory; None (a temporary one) or ``os.devnull`` (no
            files): nothing to check.

    Returns:
        None, or the reason as a short phrase without the path, e.g.
        ``"exists and is not a directory"`` or ``"cannot create a directory in it
        (Permission denied)"``. Never raises for an unusable directory.
    """
    if not log_dir or log_dir == os.devnull:
        return None
    exists = os.path.exists(log_dir)
    if exists and not os.path.isdir(log_dir):
        return "exists and is not a directory"
    # missing: nothing is made before the other checks pass (the run makes it); the nearest existing
    # ancestor must hold a new directory
    probed = os.path.abspath(log_dir)
    while not os.path.exists(probed):
        probed = os.path.dirname(probed)
    try:
        if not os.path.isdir(probed):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        os.rmdir(tempfile.mkdtemp(prefix=".elaunch_check_", dir=probed))
    except OSError as exc:
        return f"{'cannot create a directory in it' if exists else 'cannot create it'} ({exc.strerror or exc})"
    return None


class RunLogDir:
    """The job-level log directory of one agent run, created once.

    Without a ``--log-dir`` it lives in a new temporary directory, which
    :meth:`remove_if_temporary` deletes after a successful run unless a stream was
    redirected or tee'd into it (then it holds the workers' only copy of that output).

    Attributes:
        root: ``<log_dir>/<run_id>_<random>`` (a new directory; ``os.devnull`` when
            ``log_dir`` is ``os.devnull``: no files).
        spec: the LogsSpec it was made from.

    Raises (constructor):
        NotADirectoryError: ``spec.log_dir`` exists and is not a directory (names it).
        OSError: the directory cannot be created.
    """

    def __init__(self, spec: LogsSpec, run_id: str) -> None:
        self.spec = spec
        self._made: set[str] = set()
        self._temporary: str | None = None
        self._redirected = False  # some attempt sent a stream to a file on the user's behalf (-r / -t)
        base = spec.log_dir
        if base == os.devnull:
            self.root = os.devnull
            return
        if not base:
            base = self._temporary = tempfile.mkdtemp(prefix="torchelastic_")
        elif os.path.exists(base) and not os.path.isdir(base):
            raise NotADirectoryError(f"--log-dir {base}: exists and is not a directory")
        os.makedirs(base, exist_ok=True)
        safe_id = str(run_id).replace(os.sep, "_") or "run"
        # mkdtemp: a new, uniquely named directory; nothing the user had is touched.
        self.root = tempfile.mkdtemp(prefix=f"{safe_id}_", dir=base)
        log.info("log directory set to: %s", self.root)  # torch's DefaultLogsSpecs' line

    def attempt(self, attempt: int, local_world_size: int) -> AttemptLogs:
        """Create ``attempt_<attempt>/<local_rank>/`` and return the destinations.

        Calling it again with the same number replaces that attempt's directory (it
        is inside this run's own new root, as torch's ``reify`` does).

        Args:
            attempt: attempt number (>= 0).
            local_world_size: number of workers (>= 1).

        Raises:
            ValueError: a negative ``attempt`` or ``local_world_size`` < 1.
            OSError: the directories cannot be created.
        """
        if attempt < 0 or local_world_size < 1:
            raise ValueError(f"attempt={attempt}, local_world_size={local_world_size}: must be >= 0 and >= 1")
        spec = self.spec
        if self.root == os.devnull:
            return self._no_files(local_world_size)
        adir = os.path.join(self.root, f"attempt_{attempt}")
        if adir in self._made:
            shutil.rmtree(adir, ignore_errors=True)
        os.makedirs(adir)  # raises if someone else created it
        self._made.add(adir)
        logs = AttemptLogs(dir=adir)
        for lr in range(local_world_size):
            rdir = os.path.join(adir, str(lr))
            os.mkdir(rdir)
            tee = std_for(spec.tee, lr)
            redirect = std_for(spec.redirects, lr) | tee  # tee = redirect + follow the file
            shown = spec.shows_on_console(lr)
            for std, name, dest, tee_dest in (
                (Std.OUT, "stdout.log", logs.stdout, logs.tee_stdout),
                (Std.ERR, "stderr.log", logs.stderr, logs.tee_stderr),
            ):
                if redirect & std:
                    dest[lr] = os.path.join(rdir, name)
                    self._redirected = True
                    if tee & std and shown:
                        tee_dest[lr] = dest[lr]
                elif std is Std.ERR and spec.capture_stderr:
                    dest[lr] = os.path.join(rdir, name)
                    if shown:
                        tee_dest[lr] = dest[lr]
                        logs.unprefixed.add(lr)
                else:
                    dest[lr] = None if shown else os.devnull
            logs.error_file[lr] = os.path.join(rdir, "error.json")
        return logs

    def reify(self, logs: AttemptLogs, envs: dict[int, dict[str, str]]) -> None:
        """Nothing to do: :meth:`attempt` already decided every destination (see :class:`SpecsLogDir`)."""

    def remove_if_temporary(self) -> None:
        """Delete the temporary directory this object created, unless it holds redirected output.

        Called after a successful run when no ``--log-dir`` was given, so elaunch's
        own stderr capture does not pile up in /tmp; a failed run keeps it for the
        user. When some attempt redirected or tee'd a stream (``--redirects``,
        ``--tee``) the directory is kept, as torchrun keeps its temporary one: those
        files are the program's only copy of that output; an INFO line names it.
        Never raises (a directory that cannot be removed is left).
        """
        if self._temporary and self._redirected:
            log.info("kept the log directory %s: it holds the workers' redirected output", self.root)
            self._temporary = None
        elif self._temporary:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None

    def _no_files(self, local_world_size: int) -> AttemptLogs:
        """Destinations for ``log_dir=os.devnull``, as torch's ``DefaultLogsSpecs.reify``: every
        stream on the console, unprefixed (torch tees the empty /dev/null), for every local
        rank (torch applies ``local_ranks_filter`` only with a real directory), no error file."""
        logs = AttemptLogs(dir=os.devnull)
        for lr in range(local_world_size):
            logs.stdout[lr] = None
            logs.stderr[lr] = None
            logs.error_file[lr] = ""
        return logs


#: ``TORCHELASTIC_ERROR_FILE`` until a LogsSpecs' ``reify`` sets it; removed if it does not.
_UNSET_ERROR_FILE = "<set by the --logs-specs reify>"


class SpecsLogDir:
    """The run's log files as a torch ``LogsSpecs`` (``--logs-specs``) decides them.

    Same interface as :class:`RunLogDir`. :meth:`attempt` only makes the
    destinations object; :meth:`reify`, given the workers' environments, calls the
    LogsSpecs' ``reify(envs)`` as torch's agent does each time it starts a group,
    and fills it from the returned ``LogsDest``: ``stdouts``/``stderrs`` ("" is the
    console), ``tee_stdouts``/``tee_stderrs`` (files followed on the console) and
    ``error_files``; the ``TORCHELASTIC_ERROR_FILE`` the LogsSpecs puts in
    ``envs`` is the workers'. ``filtered_stdout``/``filtered_stderr`` are not
    written (``--duplicate-*-filters`` have no effect in elaunch), and stderr is
    not captured for the failure summary unless the LogsSpecs sends it to a file.

    Attributes:
        root: the LogsSpecs' ``root_log_dir``.
    """

    def __init__(self, specs: Any) -> None:
        self.specs = specs
        self.root = str(specs.root_log_dir)

    def attempt(self, attempt: int, local_world_size: int) -> AttemptLogs:
        """Return empty destinations for ``attempt``, filled by :meth:`reify`.

        Raises:
            ValueError: a negative ``attempt`` or ``local_world_size`` < 1.
        """
        if attempt < 0 or local_world_size < 1:
            raise ValueError(f"attempt={attempt}, local_world_size={local_world_size}: must be >= 0 and >= 1")
        return AttemptLogs(dir=self.root, error_file=dict.fromkeys(range(local_world_size), _UNSET_ERROR_FILE))

    def reify(self, logs: AttemptLogs, envs: dict[int, dict[str, str]]) -> None:
        """Let the LogsSpecs decide ``logs``' files from ``envs`` (local rank -> full environment).

        ``envs`` is changed in place as the LogsSpecs changes it (torch's default sets
        ``TORCHELASTIC_ERROR_FILE``).

        Raises:
            whatever the LogsSpecs' ``reify`` raises (an OSError for a directory it cannot make).
        """
        dest = self.specs.reify(envs)
        for lr, env in envs.items():
            logs.stdout[lr] = dest.stdouts.get(lr) or None
            logs.stderr[lr] = dest.stderrs.get(lr) or None
            logs.error_file[lr] = dest.error_files.get(lr, "")
            if env.get("TORCHELASTIC_ERROR_FILE") == _UNSET_ERROR_FILE:
                del env["TORCHELASTIC_ERROR_FILE"]  # as under torchrun: only what reify sets
        logs.tee_stdout = {lr: path for lr, path in dest.tee_stdouts.items() if path and lr in envs}
        logs.tee_stderr = {lr: path for lr, path in dest.tee_stderrs.items() if path and lr in envs}
        logs.unprefixed.clear()

    def remove_if_temporary(self) -> None:
        """Nothing: the LogsSpecs owns its directory (torch removes none either)."""
