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
# How long forming a group of the replicas waits for its members (each comes within a round of the generation's
# publishing), and each collective for its peers: for a replica whose serving leaves training little time (under a
# saturating load its slices still come about once a second: alchemist.runtime.time_share).
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
    # "on" (in lockstep with the others), "off" (and why), "waiting" (for a group with the others: its first, or a
    # new one after its group failed, which ``broken`` says why)
    training: str = "off"
    generation: int = 0  # of the replicas' group it trains in (or was in last: alchemist.training.generations)
    broken: str | None = None  # why its group failed (None: it did not, or it is in a newer one)


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

    def __init__(self, config: Config, index: int, num_threads: int, coordinator: str, front_node: str) -> None:
        import ray

        self.index, self.coordinator = index, coordinator
        self.node = ray.util.get_node_ip_address()
        # On the front's node a replica listens on the loopback (it needs no keys there); on another, on its node's
        # address, which the config refuses without keys.
        host = "127.0.0.1" if self.node == front_node else self.node
        self.config = replica_config(config, index, host)
        self.num_threads = num_threads
        self._sock = socket.create_server((host, 0))
        self._url = f"http://{host}:{self._sock.getsockname()[1]}"
        self._state, self._error = "starting", None
        self._engine = None  # once built
        self._lockstep = None  # once built: its training with the others
        self.training = "off" if not config.online.enabled else "waiting"
        self._thread = threading.Thread(target=self._run, name=f"replica-{index}", daemon=True)
        self._thread.start()

    def info(self) -> ReplicaInfo:
        info = ReplicaInfo(self.index, self._state, self._url, self.node, os.getpid(), self._error, self.training)
        if (lockstep := self._lockstep) is not None:
            info = dataclasses.replace(info, training="on" if lockstep.joined else "waiting",
                                       generation=lockstep.generation, broken=lockstep.broken)  # fmt: skip
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
            self._lockstep = self._join()  # None: the replica serves without training
            system = build(self.config, own_step_thread=False, lockstep=self._lockstep)
            self._engine = system.engine
            app = create_app(system)
            app.state.serving.id_tag = id_tag(self.index)
            if system.trainer is not None:  # its own responses' feedback first: it holds their records
                system.trainer.queue.own = id_tag(self.index) + "-"
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
        """This replica's place in the replicas' training (None: training off). Its group forms later, when the
        front publishes a generation with it (once it serves: alchemist.scale.front), and again whenever the
        replicas alive change; a restarted replica resumes from its own last checkpoint and catches up there."""
        if not self.config.online.enabled:
            return None
        import torch

        from alchemist.training.data_parallel import DataParallel
        from alchemist.training.generations import Generations
        from alchemist.training.lockstep import Lockstep

        device = torch.device("cuda" if self.config.engine.device == "cuda" else "cpu")
        try:
            generations = Generations.connect(self.coordinator)
        except Exception as e:
            return self._serve_untrained(f"could not reach the replicas' coordinator ({type(e).__name__}: {e})")
        return Lockstep(DataParallel(device), generations=generations, index=self.index, timeout_s=GROUP_TIMEOUT_S)

    def _serve_untrained(self, why: str) -> None:
        log.error("replica %d serves without training: %s", self.index, why)
        self.training = f"off: {why}"
        self.config = dataclasses.replace(self.config, online=dataclasses.replace(self.config.online, enabled=False))


def replica_actor(config: Config, index: int, num_cpus: int, coordinator: str, front_node: str):
    """A Ray actor running replica ``index`` on ``num_cpus`` cores (its torch threads), restarted by Ray whenever
    its process dies; the replicas' process groups form at ``coordinator`` (``host:port`` of the front's store:
    alchemist.training.generations); ``front_node``: the front's node's address."""
    import ray

    actor_class = ray.remote(Replica)
    return actor_class.options(
        name=f"alchemist-replica-{index}",
        num_cpus=num_cpus,
        max_restarts=-1,
        max_concurrency=4,  # info() answers while __init__'s threads load and serve
    ).remote(config, index, num_cpus, coordinator, front_node)
