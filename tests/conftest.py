import os
import sys

# Tests run on 2 cores; keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.dont_write_bytecode = True
