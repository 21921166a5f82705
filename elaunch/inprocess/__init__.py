"""In-process restart: a fault costs the failed rank, not the job (issue 37).

A script opts in with :func:`elaunch.restartable` (``elaunch.inprocess.worker``). On a
fault anywhere on its node (a worker died, or one raised) the agent interrupts the
survivors' ``main()`` instead of stopping them, counts and decides the restart as
for any failure, joins the next round, starts new processes only for the local
ranks that died, and hands the survivors the new round's environment: they call
``main()`` again in the same process.

The feature's parts, side by side:

* :mod:`~elaunch.inprocess.wire`: the control channel's messages (JSON lines; stdlib).
* :mod:`~elaunch.inprocess.worker`: the worker's wrapper (``restartable``; torch
  imported only inside it, when a process group is torn down).
* :mod:`~elaunch.inprocess.channel`: the agent's end of the channel, one listening
  socket and a thread, each connection authenticated by the kernel's peer credentials.
* :mod:`~elaunch.inprocess.decide`: the pure decisions (does a fault go in process,
  which ranks are kept).
* :mod:`~elaunch.inprocess.restarts`: the agent's side of a restart in process
  (a watchdog of the monitor, the survivors kept across the rejoin, the "go").

Nothing here imports torch at import time: the agent imports this package.
"""
