"""``python launch_main.py elaunch|torchrun ARGS...``: the launcher's Python API, ``main(ARGS)``.

As PyTorch's launcher tests call it (``torch.distributed.run.main([...])``), and
``elaunch.run.main([...])`` the same way: a failed job raises (a traceback, status 1).
"""
import importlib
import sys

module = {"elaunch": "elaunch.run", "torchrun": "torch.distributed.run"}[sys.argv[1]]
importlib.import_module(module).main(sys.argv[2:])
