"""``alchemist serve --replicas N``: N replicas on Ray behind one front, until SIGINT or SIGTERM.

    serve_replicas(config)       # joins config.scale.ray_address, or starts a local Ray cluster; blocks

Each replica is a Ray actor (``alchemist.scale.replica``) on its share of a node's cores (or one GPU each on CUDA),
restarted by Ray when its process dies; the front (``alchemist.scale.front``) listens on the server's host and port
in this process. On the way out the replicas are killed, and a local cluster shut down.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from alchemist.config import Config
from alchemist.scale.front import create_front
from alchemist.scale.replica import replica_actor
from alchemist.scale.replica_set import Handle, ReplicaSet
from alchemist.training.generations import Generations

log = logging.getLogger(__name__)


def replica_cpus(config: Config) -> int:
    """Each replica's cores: this machine's, split evenly (at least one each)."""
    return max(1, (os.cpu_count() or 1) // config.scale.replicas)


def start_ray(config: Config) -> None:
    """Join the cluster of ``--ray-address``, or start a local one of this machine's cores. Workers find our package
    where this process found it (a checkout that is not installed included)."""
    import ray

    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    runtime_env = {"env_vars": {"PYTHONPATH": path}}
    if config.scale.ray_address is not None:
        ray.init(address=config.scale.ray_address, runtime_env=runtime_env, log_to_driver=True)
    else:
        # Ray's object store holds nothing of ours (replicas talk HTTP): the smallest it allows.
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, object_store_memory=80 << 20,
                 runtime_env=runtime_env)  # fmt: skip


def serve_replicas(config: Config) -> None:
    import ray
    import uvicorn

    start_ray(config)
    cpus = replica_cpus(config)
    # The replicas' process groups form at a store in this process: it outlives any replica (training.generations).
    node = ray.util.get_node_ip_address()
    generations = Generations.host(node) if config.online.enabled else None
    coordinator = generations.address if generations is not None else ""
    actors = [replica_actor(config, index, cpus, coordinator, node) for index in range(config.scale.replicas)]
    replicas = ReplicaSet([Handle(index, actor) for index, actor in enumerate(actors)], generations)
    app = create_front(replicas, config.server)
    server = config.server
    print(f"alchemist: {config.scale.replicas} replicas of {cpus} cores each, front at "
          f"http://{server.host}:{server.port}/v1", flush=True)  # fmt: skip
    try:
        uvicorn.run(app, host=server.host, port=server.port, log_level="info")  # SIGINT / SIGTERM end it
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        ray.shutdown()
