"""A module for --warm-start-modules that starts a Python thread as it is imported (a warm
template must not fork then: the child would hold a copy of that thread's locks, not the thread)."""
import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="warm-thread-probe").start()
