"""The `dist` backend: one process per worker over torch.distributed (gloo on CPU, NCCL on GPU).

- `launch`: `ftbench backend=dist` starts the processes with PyTorch's elastic launcher;
  `python -m ftbench.distributed` is the same job under torchrun (multi-node).
- `worker`: one process: its threads, its process group, the shared run loop.
- `engine`: this rank's worker and its ops of the plan (the local backend's WorkerExecutor, on
  the engine state both backends share, ftbench.engine.state).
- `backend`: the run loop's Backend protocol for one rank: strikes, detection and agreement,
  recovery actions and restarts.
- `faults`: how a process dies, and the deaths and pauses backend.kill and backend.stall inject.
- `transport`: the transport seam over point-to-point messages and per-fragment groups.

- `agent`: one node's elastic agent, when the run has failures (one agent per node, so a
  node's death ends only its own processes).
- `membership`: heartbeats, failure detection and agreement through the job's store.
- `torchrun_restarts`: the ranks of processes torchrun starts again after a RestartJob.
- `protocol`: the names every process of a job agrees on (environment variables, store keys,
  exit codes) and the job's layout; every other module may import it.

Importing this package does not import torch.
"""
