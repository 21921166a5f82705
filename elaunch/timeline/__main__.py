import sys

from elaunch.timeline import main

sys.exit(main(sys.argv[1:]))
