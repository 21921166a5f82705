"""Worker of the exit test: does the workers' store outlive the first worker to exit?

argv[1]: output dir. Joins a gloo world from ``env://`` (the agent's store,
``TORCHELASTIC_USE_AGENT_STORE=True``) and all-reduces once, as PyTorch's
init-method test script. Rank 0 then writes its pid and exits at once; every
other rank waits until that process is gone (or fails after 60 s) and then sets
and gets a key through the default store, writing ``store_<RANK>.txt`` ("ok" or
the error). Every rank destroys its group before exiting, so that gloo's teardown
race at interpreter exit (issue 22, item 2) cannot fail the test. Every catchable
signal a worker gets (the agent's stop, interrupt, notices, the stacks signal) is
recorded and appended to that file: the agent must leave the remaining workers alone
until they exit (torchrun's agent only polls them).
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

out = sys.argv[1]
got = []
_stacks = int(os.environ.get("ELAUNCH_STACKS_SIGNAL", "0"))
for _sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             *([_stacks] if _stacks else [])):
    signal.signal(_sig, lambda signum, frame: got.append(signal.Signals(signum).name if signum in iter(
        signal.Signals) else str(signum)))
dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
if rank == 0:
    with open(os.path.join(out, "rank0.pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, "rank0.pid.tmp"), os.path.join(out, "rank0.pid"))
    dist.destroy_process_group()
    sys.exit(0)
pid_file = os.path.join(out, "rank0.pid")
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # rank 0 gone: its agent saw a worker exit
    try:
        with open(pid_file) as f:
            os.kill(int(f.read()), 0)
    except (FileNotFoundError, ValueError):
        pass  # not written yet
    except ProcessLookupError:
        break
    time.sleep(0.02)
else:  # without this the store would be tried while rank 0 still lives, and pass for nothing
    sys.exit("rank 0 was still alive after 60 s")
try:
    store = dist.distributed_c10d._get_default_store()
    store.set(f"after_exit_{rank}", "1")
    result = "ok" if store.get(f"after_exit_{rank}") == b"1" else "wrong value"
except Exception as exc:  # noqa: BLE001 - the test reads what went wrong
    result = f"{type(exc).__name__}: {exc}"
with open(os.path.join(out, f"store_{rank}.txt"), "w") as f:
    f.write(result + (f"; signals: {', '.join(got)}" if got else ""))
dist.destroy_process_group()
