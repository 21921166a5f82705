"""A worker whose entrypoint is decorated with elaunch's or torch's ``@record``.

Usage: err_record.py {elaunch|torch} {raise|exit0|exit3|ok|chained}
  raise    raise ValueError("boom 42")          → error file, exit 1
  chained  raise KeyError from a ValueError     → error file with both tracebacks
  exit0    sys.exit(0)                           → no file, exit 0
  exit3    print to stderr, sys.exit(3)          → no file, exit 3
  ok       return normally                       → no file, exit 0
Prints "returned" after the decorated call returns.
"""

import sys

which, mode = sys.argv[1], sys.argv[2]
if which == "torch":
    from torch.distributed.elastic.multiprocessing.errors import record
else:
    from elaunch.errors import record


@record
def main():
    if mode == "raise":
        raise ValueError("boom 42")
    if mode == "chained":
        try:
            raise ValueError("inner cause")
        except ValueError as exc:
            raise KeyError("outer") from exc
    if mode == "exit0":
        sys.exit(0)
    if mode == "exit3":
        print("giving up with status 3", file=sys.stderr, flush=True)
        sys.exit(3)
    return None


main()
print("returned", flush=True)
if which == "elaunch":
    print("torch imported" if "torch" in sys.modules else "torch not imported", flush=True)
