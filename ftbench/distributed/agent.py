"""One node of a dist job on this machine: PyTorch's elastic agent for that node's processes.

`python -m ftbench.distributed.agent JOB NODE NODES GPUS ENDPOINT RUN_ID RESTARTS` is what
`ftbench backend=dist` starts once per node (standbys included) when the run has failures, and
again per node still up after each restart of the job (RESTARTS: how many so far): a node's
death (SIGKILL of its processes) then ends only its own agent, and the other agents' workers
carry on, as with one `torchrun` per node on a cluster. The agents meet through c10d
rendezvous in the store the launcher hosts (so no node's death takes the store with it), and
the short exit barrier keeps the survivors from waiting for agents that died.

The leader posts its results in that store (ftbench.distributed.protocol.RESULT_KEY).
"""
from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

EXIT_BARRIER_S = 2.0  # the agents of dead nodes never arrive


def main(argv: list[str]) -> int:
    job_path, node, nodes, gpus, endpoint, run_id, incarnation = argv
    node, nodes, gpus = int(node), int(nodes), int(gpus)
    job = pickle.loads(Path(job_path).read_bytes())
    from ftbench.distributed.protocol import NODE_ENV, shutdown_timeout

    os.environ[NODE_ENV] = str(node)  # its processes' ranks follow from it (worker.env_ranks), after restarts too
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    from ftbench.distributed import worker

    start_method = worker.start_method()
    if start_method == "fork":
        worker.preload()
    folder = Path(job["error_dir"])
    timeout = float(job["cfg"].backend.timeout_s)
    params = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id=run_id, min_nodes=nodes,
                                  max_nodes=nodes, local_addr="127.0.0.1", is_host=False,
                                  join_timeout=int(max(timeout, 1)), last_call_timeout=1)
    spec = WorkerSpec(role="ftbench", local_world_size=gpus, entrypoint=worker.rank_main, args=(worker.entry, job),
                      rdzv_handler=registry.get_rendezvous_handler(params), max_restarts=0,
                      monitor_interval=0.05, local_addr="127.0.0.1")
    logs_dir = folder / "logs" / (f"node{node}" if incarnation == "0" else f"node{node}-restart{incarnation}")
    logs = DefaultLogsSpecs(log_dir=str(logs_dir), redirects=Std.ALL)
    agent = LocalElasticAgent(spec, logs, start_method=start_method, exit_barrier_timeout=EXIT_BARRIER_S,
                              **shutdown_timeout(LocalElasticAgent))
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
