import sys

from cpu_worker.worker import main

sys.exit(main())
