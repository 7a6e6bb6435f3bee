"""The runtime: the system that serves and trains, assembled from the config tree, with no HTTP front.

    system = build(config)                   # model, store, engine, feedback log, checkpoints, trainer, stepping loop
    system.async_engine.run_steps()          # step in this thread (or start() it on an event loop: its own thread)
    system.close()

``alchemist.server`` puts the HTTP front on a built ``System`` (``create_app``); a replica that serves and trains
without one uses the same ``System``.
"""

from alchemist.runtime.build import build, build_around, served_model_names
from alchemist.runtime.system import System

__all__ = ["System", "build", "build_around", "served_model_names"]
