"""The `dist` backend: one process per worker over torch.distributed (gloo on CPU, NCCL on GPU).

- `launch`: `ftbench backend=dist` starts the processes with PyTorch's elastic launcher;
  `python -m ftbench.distributed` is the same job under torchrun (multi-node).
- `worker`: one process: its threads, its process group, the shared run loop.
- `engine`: this rank's worker and its ops of the plan (the local backend's WorkerExecutor),
  and the run loop's Backend protocol.
- `transport`: the transport seam over point-to-point messages and per-fragment groups.

- `agent`: one node's elastic agent, when the run has failures (one agent per node, so a
  node's death ends only its own processes).
- `membership`: heartbeats, failure detection and agreement through the job's store.
Importing this package does not import torch.
"""
