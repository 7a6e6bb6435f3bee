"""A replica: one complete Alchemist server (the runtime's ``System`` and its HTTP front) inside a Ray actor.

    actor = replica_actor(config, index, num_cpus)          # a Ray actor handle; Ray restarts it if it dies
    info = ray.get(actor.info.remote())                     # ReplicaInfo: where it serves, its state

``__init__`` returns at once: a thread builds the system (loads the model, probes the latency objective) and then
steps it, as ``alchemist serve``'s main thread does, and uvicorn serves the app on a port it bound already. A replica
that Ray restarts runs ``__init__`` again and comes back by itself, on a new port: the front (``alchemist.scale.
front``) reads ``info`` to follow it. Each replica keeps its own state under ``DATA_DIR/replica-INDEX`` (its
activation store's disk tier, its adapter checkpoints); the feedback log is the one the replicas share.

Its responses' ids carry its index (``chatcmpl-r1-...``): feedback on a response finds the replica that holds its
record from the id alone (``replica_of``), with nothing to remember in the front.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from alchemist.config import Config

log = logging.getLogger(__name__)

_TAGGED = re.compile(r"^(?:chatcmpl|cmpl)-r(\d+)-")
# How long joining the replicas' process group, and then each collective, waits for the others: the first for their
# model loads, the second for a replica whose serving leaves training little time (under a saturating load its
# slices still come about once a second: alchemist.runtime.time_share).
GROUP_TIMEOUT_S = 300.0


def id_tag(index: int) -> str:
    """What replica ``index`` puts after a response id's prefix."""
    return f"-r{index}"


def replica_of(response_id: str) -> int | None:
    """The index of the replica that served ``response_id`` (None: not a replica's id)."""
    match = _TAGGED.match(response_id)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class ReplicaInfo:
    index: int
    state: str  # "starting" | "ready" | "failed"
    url: str | None  # http://host:port, once bound
    node: str  # the node's IP address
    pid: int
    error: str | None = None  # why it failed (``failed`` only)
    adapter_version: int = 0  # the version it serves
    running: int = 0  # requests decoding or prefilling
    waiting: int = 0  # requests waiting for admission
    records: int = 0  # activation records its store holds
    training: str = "off"  # "on" (in lockstep with the others), "off" (and why), "stopped: ..." (its group failed)


def replica_config(config: Config, index: int, host: str) -> Config:
    """The config replica ``index`` runs: one process's server on ``host`` and a port the replica binds itself, with
    its own data directory and the shared feedback log."""
    server = dataclasses.replace(
        config.server,
        host=host,
        port=0,
        data_dir=str(Path(config.server.data_dir) / f"replica-{index}"),
    )
    return dataclasses.replace(config, server=server, scale=dataclasses.replace(config.scale, replicas=1))


class Replica:
    """The actor's class (``replica_actor`` makes the Ray actor): a server that builds and serves in threads of its
    own, so that ``info`` answers while it loads."""

    def __init__(self, config: Config, index: int, num_threads: int, rendezvous: str, num_replicas: int) -> None:
        import ray

        self.index, self.rendezvous, self.num_replicas = index, rendezvous, num_replicas
        self.node = ray.util.get_node_ip_address()
        host = "127.0.0.1" if config.scale.ray_address is None else self.node  # a local cluster stays on loopback
        self.config = replica_config(config, index, host)
        self.num_threads = num_threads
        self._sock = socket.create_server((host, 0))
        self._url = f"http://{host}:{self._sock.getsockname()[1]}"
        self._state, self._error = "starting", None
        self._engine = None  # once built
        self._lockstep = None  # once joined
        self.training = "on" if config.online.enabled else "off"
        self._thread = threading.Thread(target=self._run, name=f"replica-{index}", daemon=True)
        self._thread.start()

    def info(self) -> ReplicaInfo:
        training = self.training
        if self._lockstep is not None and self._lockstep.broken is not None:
            training = f"stopped: {self._lockstep.broken}"
        info = ReplicaInfo(self.index, self._state, self._url, self.node, os.getpid(), self._error, training=training)
        if self._engine is None:
            return info
        stats = self._engine.stats()
        return dataclasses.replace(info, adapter_version=self._engine.adapter_version, running=stats.num_running,
                                   waiting=stats.num_waiting, records=stats.activation_records)  # fmt: skip

    def _run(self) -> None:
        """Build the system in this thread, serve HTTP from a second one, and step the engine here until the
        process ends (Ray kills the actor)."""
        import torch
        import uvicorn

        from alchemist.runtime import build
        from alchemist.server.app import create_app

        try:
            torch.set_num_threads(self.num_threads)  # this thread's own setting: the one that steps
            self._lockstep = self._join()  # first: without it the replica serves without training
            system = build(self.config, own_step_thread=False, lockstep=self._lockstep)
            self._engine = system.engine
            app = create_app(system)
            app.state.serving.id_tag = id_tag(self.index)
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
            http = threading.Thread(target=server.run, kwargs={"sockets": [self._sock]}, name="uvicorn", daemon=True)
            http.start()
            while not server.started and http.is_alive():
                threading.Event().wait(0.05)
            if not http.is_alive():
                raise RuntimeError("the replica's HTTP server did not start")
            self._state = "ready"
            log.info("replica %d serving at %s", self.index, self._url)
            system.async_engine.run_steps()
        except Exception as e:  # the front sees it in info() and stops routing here
            log.exception("replica %d failed", self.index)
            self._state, self._error = "failed", f"{type(e).__name__}: {e}"


    def _join(self):
        """This replica's place in the replicas' training (None: training off): joins their process group, which
        waits for every replica (each loads its model first)."""
        if not self.config.online.enabled:
            return None
        import ray
        import torch

        if ray.get_runtime_context().was_current_actor_reconstructed:  # the group it was in formed without it
            return self._serve_untrained("restarted after the replicas' group formed: rejoining it is not built yet")

        from alchemist.training.data_parallel import DataParallel
        from alchemist.training.lockstep import Lockstep

        device = torch.device("cuda" if self.config.engine.device == "cuda" else "cpu")
        try:
            return Lockstep(DataParallel.join(self.rendezvous, self.index, self.num_replicas, device, GROUP_TIMEOUT_S))
        except Exception as e:
            return self._serve_untrained(f"could not join the replicas' group ({type(e).__name__}: {e})")

    def _serve_untrained(self, why: str) -> None:
        log.error("replica %d serves without training: %s", self.index, why)
        self.training = f"off: {why}"
        self.config = dataclasses.replace(self.config, online=dataclasses.replace(self.config.online, enabled=False))


def replica_actor(config: Config, index: int, num_cpus: int, rendezvous: str):
    """A Ray actor running replica ``index`` on ``num_cpus`` cores (its torch threads), restarted by Ray whenever
    its process dies; the replicas' process group meets at ``rendezvous`` (``tcp://HOST:PORT``)."""
    import ray

    actor_class = ray.remote(Replica)
    return actor_class.options(
        name=f"alchemist-replica-{index}",
        num_cpus=num_cpus,
        max_restarts=-1,
        max_concurrency=4,  # info() answers while __init__'s threads load and serve
    ).remote(config, index, num_cpus, rendezvous, config.scale.replicas)
