"""build(config) -> System: the replica that ``alchemist serve`` runs, assembled from the config tree.

    system = build(Config())                                      # loads the model of config.engine
    system = build_around(engine, Config(), names=["m"])          # around an engine already made (tiny models)

One code path: ``build`` loads the model and makes the activation store and the engine, ``build_around`` the rest
(feedback log, adapter checkpoints, the online trainer or the adapter training left serving, the latency objective,
the time share and the stepping loop). Every default comes from the config tree; the calls into training and the
feedback log are here only, so that a change of their constructors touches this file alone.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

from alchemist.activations.store import ActivationStore
from alchemist.config import Config, ServerConfig
from alchemist.engine import LLMEngine
from alchemist.feedback.backends import open_feedback_log
from alchemist.model.loader import load_model
from alchemist.model.peft_format import load_adapter
from alchemist.runtime.async_engine import AsyncEngine
from alchemist.runtime.objective import resolve_objective
from alchemist.runtime.system import System
from alchemist.runtime.time_share import TimeShare
from alchemist.runtime.trainers import Trainers, named_trainer
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.lineage import as_trained
from alchemist.training.lockstep import Lockstep
from alchemist.training.online import OnlineTrainer


def build(config: Config, own_step_thread: bool = True, lockstep: Lockstep | None = None) -> System:
    """Loads the model of ``config.engine`` and builds the system around a fresh engine, recording per
    ``config.record`` into a store the trainer replays from. With ``own_step_thread`` False the caller runs
    ``system.async_engine.run_steps()`` (``alchemist serve`` does, in the main thread: the Note in async_engine);
    ``lockstep``: a replica that trains in lockstep with others (``alchemist.scale.replica``)."""
    loaded = load_model(config.engine.model, dtype=config.engine.dtype, device=config.engine.device)
    if config.record.disk_dir is None:  # the disk tier's files live with the server's other state
        disk_dir = str(Path(config.server.data_dir) / "activations")
        config = dataclasses.replace(config, record=dataclasses.replace(config.record, disk_dir=disk_dir))
    store = ActivationStore.from_config(config.record)  # the engine records into it, the trainer replays from it
    engine = LLMEngine(loaded.model, loaded.tokenizer, config.engine, config.record, store)
    names = served_model_names(config.server, loaded.source, config.engine.model)
    return build_around(engine, config, names, store, own_step_thread, lockstep)


def build_around(
    engine: LLMEngine,
    config: Config,
    names: list[str],
    store: ActivationStore | None = None,
    own_step_thread: bool = True,
    lockstep: Lockstep | None = None,
) -> System:
    """The system around ``engine`` (made with its own record settings; ``config.engine`` and ``config.record`` are
    not read here), with the online trainer of ``config.online`` stepping beside it: it replays from ``store`` (the
    one the engine records into: by default ``engine.store``) and publishes to the engine, which it knows only by
    ``alchemist.training.seams``' Protocols. The feedback log and the adapters live under ``config.server``'s
    data_dir. The named adapters of ``config.server.lora_modules``, and those loaded at run time
    (``Trainers.start``), are trained too, each by a trainer of its own (``alchemist.runtime.trainers``; not in
    lockstep, whose replicas train the shared adapter only). The latency objective is the engine's config's, its
    zeros derived here from probe steps (``alchemist.runtime.objective``): call this in the thread that will step
    the engine."""
    online, server = config.online, config.server
    store = store if store is not None else engine.store
    feedback_log = open_feedback_log(server.feedback_db_path)
    checkpoints = AdapterCheckpoints(Path(server.data_dir) / "adapters", online.adapter.keep_versions)
    objective = resolve_objective(engine)  # probe steps, if derived: before any request
    trainer = trainers = time_share = None
    if online.enabled:
        trainer = OnlineTrainer.from_config(engine.model, engine.tokenizer, engine, store, feedback_log, checkpoints,
                                            online, lockstep)  # resumes from its checkpoint  # fmt: skip
        make = partial(named_trainer, engine, store, feedback_log, online, server.data_dir)
        trainers = Trainers(trainer, make if lockstep is None else None)
        for name, path in server.lora_module_paths if lockstep is None else ():
            initial = load_adapter(Path(path), engine.model.config, engine.model.device)
            trainers.add(name, make(name, initial))
        time_share = TimeShare(trainers, objective, engine.waiting_since)
    elif (serving := checkpoints.serving()) is not None:  # training off: serve the version training left serving
        adapter, _, _ = checkpoints.load(serving.version, engine.model.config, engine.model.device)
        undone = serving.metrics.get("undone", [])
        engine.set_adapter(as_trained(adapter, online.adapter, feedback_log, serving.version, undone), serving.version)
    async_engine = AsyncEngine(engine, own_step_thread=own_step_thread, time_share=time_share)
    feedback_log.add_listener(lambda entry: async_engine.wake())  # new feedback: the trainer may have a batch
    return System(config, engine, store, feedback_log, checkpoints, trainer, objective, time_share, async_engine,
                  names, trainers)  # fmt: skip


def served_model_names(server_config: ServerConfig, source: Path, model_arg: str | None) -> list[str]:
    """The name responses carry first (--served-model-name, else the model's stem), then the path as given."""
    names = [server_config.served_model_name or source.stem]
    for alias in (model_arg, str(source)):
        if alias and alias not in names:
            names.append(alias)
    return names
