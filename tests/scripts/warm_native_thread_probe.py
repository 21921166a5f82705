"""A module for --warm-start-modules that starts a native thread as it is imported, as a C
library's thread pool does: ``threading`` does not list it, and a warm template must not fork."""
import ctypes

_libc = ctypes.CDLL(None)
_tid = ctypes.c_ulong()
# pause() as the thread's start routine: it ignores its argument and sleeps until the process ends
if _libc.pthread_create(ctypes.byref(_tid), None, _libc.pause, None) != 0:
    raise OSError("pthread_create failed")
