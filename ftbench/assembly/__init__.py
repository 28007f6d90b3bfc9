"""Each backend's run, assembled from the shared parts (ftbench/job.py, the run loop) and the
backend's own: `sim` (ftbench/assembly/sim.py) and `local` (ftbench/assembly/local.py); `dist`
assembles its run in its own processes (ftbench/distributed/launch.py and worker.py).
ftbench/run.py picks one by `backend`."""
