"""A worker that sleeps argv[1] seconds (agent-overhead benchmark); no torch import."""
import sys
import time

time.sleep(float(sys.argv[1]))
