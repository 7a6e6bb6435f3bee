"""System: the built parts of a replica that serves and trains (``alchemist.runtime.build`` makes one).

    system = build(config)
    system.observe(on_outputs=metrics.observe)   # observers before the loop starts (server/app.py's metrics)
    system.async_engine.start()                  # the stepping loop (engine steps, training's slices), on an
                                                 # event loop; or run_steps() in this thread (run_server)
    system.close()

The parts are plain attributes: whoever puts a front on the system (the HTTP app) reads them; nothing here knows
about HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from alchemist.activations.store import ActivationStore
from alchemist.config import Config
from alchemist.engine import LLMEngine, RequestOutput
from alchemist.feedback.log import FeedbackEntry, FeedbackLog
from alchemist.runtime.async_engine import AsyncEngine
from alchemist.runtime.objective import LatencyObjective
from alchemist.runtime.time_share import TimeShare
from alchemist.runtime.trainers import Trainers
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.online import OnlineTrainer


@dataclass
class System:
    config: Config  # what it was built with (the record section's disk_dir resolved)
    engine: LLMEngine
    store: ActivationStore  # the engine records into it, the trainer replays from it
    feedback_log: FeedbackLog
    checkpoints: AdapterCheckpoints
    trainer: OnlineTrainer | None  # None: training off (the version training left serving is served)
    objective: LatencyObjective  # the TPOT and TTFT serving keeps to (set, or derived at start-up)
    time_share: TimeShare | None  # training's slices between engine steps (None without a trainer)
    async_engine: AsyncEngine  # the stepping loop, and the bridge that streams its outputs to asyncio
    names: list[str]  # the model names served: the one responses carry first, then its aliases
    trainers: Trainers | None = None  # the shared trainer and the named adapters' (None without a trainer)

    def observe(
        self,
        on_outputs: Callable[[Sequence[RequestOutput]], None] | None = None,
        on_step_s: Callable[[float], None] | None = None,
        on_slice: Callable[[float, bool], None] | None = None,
        on_feedback: Callable[[FeedbackEntry], None] | None = None,
    ) -> None:
        """Attach observers (the server's metrics) to the parts, before the stepping loop starts. They are attached
        after the build rather than passed to it because the observer is made around built parts (ServerMetrics
        reads the engine's stats) and belongs to the front (Prometheus is an HTTP concern): the runtime only calls
        back. The step and output callbacks run in the stepping thread, the feedback one in the appending thread."""
        if on_outputs is not None:
            self.async_engine.on_outputs = on_outputs
        if on_step_s is not None:
            self.async_engine.on_step_s = on_step_s
        if on_slice is not None and self.time_share is not None:
            self.time_share.on_slice = on_slice
        if on_feedback is not None:
            self.feedback_log.add_listener(on_feedback)

    def close(self) -> None:
        """Stop the stepping loop (it closes the engine, and with it the store, as it ends), then close the feedback
        log: only then, since the trainer reads the log until the loop ends."""
        self.async_engine.shutdown()
        self.feedback_log.close()
