import sys

from gpu_worker.worker import main

sys.exit(main())
