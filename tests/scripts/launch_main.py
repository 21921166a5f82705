"""``python launch_main.py elaunch|torchrun ARGS...``: the launcher's Python API, ``main(ARGS)``.

As PyTorch's launcher tests call it (``torch.distributed.run.main([...])``), and
``elaunch.run.main([...])`` the same way: a failed job raises (a traceback, status 1).
The guard matters: torch's ``--run-path`` workers are spawned, and re-import this
file as ``__mp_main__``.
"""
import importlib
import sys

if __name__ == "__main__":
    module = {"elaunch": "elaunch.run", "torchrun": "torch.distributed.run"}[sys.argv[1]]
    importlib.import_module(module).main(sys.argv[2:])
