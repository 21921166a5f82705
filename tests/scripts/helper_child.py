"""A tiny helper child for the helper-process tests: ``helper_child.py FD [ignore-term] [ignore-eof]``.

Serves its channel FD (one message per packet): ``ping`` -> ``pong``; ``exit N``
-> exits with status N; ``fork`` -> forks a sleeper (in this process group, no
channel, no ``PR_SET_PDEATHSIG``) and answers its pid. End of file: exits 0, or
with ``ignore-eof`` waits for a signal. With ``ignore-term`` it ignores SIGTERM.
"""

import os
import signal
import socket
import sys


def main(fd: int, *modes: str) -> int:
    if "ignore-term" in modes:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    chan = socket.socket(fileno=fd)
    while True:
        words = chan.recv(4096).decode().split()
        if not words:
            while "ignore-eof" in modes:
                signal.pause()
            return 0
        if words[0] == "exit":
            return int(words[1])
        if words[0] == "fork":
            pid = os.fork()
            if pid == 0:
                chan.close()
                while True:
                    signal.pause()
            chan.send(str(pid).encode())
        elif words[0] == "ping":
            chan.send(b"pong")


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), *sys.argv[2:]))
