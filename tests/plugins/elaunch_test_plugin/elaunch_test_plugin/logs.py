"""``elaunch-test-flat``: a LogsSpecs that writes every worker's output flat, under its own names.

``<log_dir>/<run_id>/rank<RANK>.attempt<TORCHELASTIC_RESTART_COUNT>.{out,err,error.json}``,
stdout and stderr always redirected there; ``--tee`` streams are also followed on the console.
"""

from __future__ import annotations

import os
import tempfile

from torch.distributed.elastic.multiprocessing import LogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import LogsDest


class FlatLogsSpecs(LogsSpecs):
    def __init__(self, log_dir=None, redirects=Std.NONE, tee=Std.NONE, local_ranks_filter=None):
        super().__init__(log_dir or tempfile.mkdtemp(prefix="flat_"), redirects, tee, local_ranks_filter)

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs):
        dest = LogsDest()
        for local_rank, env in envs.items():
            run_dir = os.path.join(self._root_log_dir, env["TORCHELASTIC_RUN_ID"])
            os.makedirs(run_dir, exist_ok=True)
            base = os.path.join(run_dir, f"rank{env['RANK']}.attempt{env['TORCHELASTIC_RESTART_COUNT']}")
            dest.stdouts[local_rank] = base + ".out"
            dest.stderrs[local_rank] = base + ".err"
            dest.error_files[local_rank] = env["TORCHELASTIC_ERROR_FILE"] = base + ".error.json"
            tee = self._tee.get(local_rank, Std.NONE) if isinstance(self._tee, dict) else self._tee
            if tee & Std.OUT:
                dest.tee_stdouts[local_rank] = dest.stdouts[local_rank]
            if tee & Std.ERR:
                dest.tee_stderrs[local_rank] = dest.stderrs[local_rank]
        return dest
