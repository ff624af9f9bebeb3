import os
import sys

from cpu_worker.worker import main

rc = main()
sys.stdout.flush()
sys.stderr.flush()
# Skip interpreter teardown: with torch loaded it takes ~1 s, longer than the coordinator
# should wait for a worker to stop.
os._exit(rc)
