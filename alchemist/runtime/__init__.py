"""The runtime: the system that serves and trains, assembled from the config tree, with no HTTP front.

    system = build(config)                   # model, store, engine, feedback log, checkpoints, trainer, stepping loop
    system.async_engine.start()              # on an asyncio loop: the stepping thread starts (tests/runtime)
    stream = system.async_engine.generate(request_id, prompt_ids, params)     # feedback: system.feedback_log
    system.close()

``alchemist.server`` puts the HTTP front on a built ``System`` (``create_app``); a replica that serves and trains
without one uses the same ``System``.
"""

from alchemist.runtime.build import build, build_around, served_model_names
from alchemist.runtime.system import System

__all__ = ["System", "build", "build_around", "served_model_names"]
