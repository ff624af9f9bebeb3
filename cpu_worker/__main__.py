import sys

from cpu_worker.worker import main

sys.exit(main())  # main() ends the process with os._exit after a clean stop
