"""AsyncEngine: the synchronous ``LLMEngine`` stepped by one thread, streamed to asyncio callers.

    stream = async_engine.generate(request_id, prompt_ids, params)   # admission errors raise here
    async for out in stream: ...                                      # RequestOutput per step with new tokens

One thread owns ``engine.step()`` (``run_steps``); it sleeps on a condition variable while there is no work (no
busy spin). That is a thread of its own by default, or the caller's: ``alchemist serve`` steps in the main thread
and runs the event loop in a second one, because of the Note below.
Each step's outputs go to the event loop in one ``call_soon_threadsafe`` call, which routes them to per-request
asyncio queues. A stream that is closed before its request finished (client disconnect, cancelled task) aborts
the request, which frees its KV blocks. ``add_request`` and ``abort`` are thread-safe in the engine, so the event
loop calls them directly.

Training beside serving: a ``TimeShare`` (``alchemist.runtime.time_share``, the policy: what the latency objective
leaves training) gets the stepping thread between engine steps, for slices of the online trainer's work; this loop
only tells it how long each step took and when serving is idle.

Overload: the engine's waiting queue is bounded (``EngineConfig.max_waiting``); ``add_request`` raises the
engine's QueueFullError (a 429) instead of letting it grow.

Note: [OpenMP and the stepping thread] torch's CPU ops parallelize with OpenMP. Once the main thread has run
parallel regions (loading the model does), ops issued from any other thread ran at about one-thread speed on the
2-core target (docs/benchmarks.md, "OpenMP and the stepping thread"). Stepping in the thread that loaded the model
avoids it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from alchemist.engine import LLMEngine, RequestOutput, SamplingParams
from alchemist.runtime.time_share import TimeShare

logger = logging.getLogger(__name__)

IDLE_POLL_S = 1.0  # with background work pending on a timer (a batch's max wait), look again this often


class EngineDeadError(RuntimeError):
    """engine.step() raised; the requests in flight at that moment fail with this."""


class RequestStream:
    """Async iterator over one request's outputs; ends after the output marked finished."""

    def __init__(self, owner: AsyncEngine, request_id: str, on_finish: Callable[[], None] | None = None):
        self.owner = owner
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.on_finish = on_finish  # called once, on the event loop, when the request is done with (or aborted)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()  # a CancelledError here leaves the request to aclose()
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item.finished:
            self._finish()
        return item

    async def aclose(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        if not self.finished:
            self._finish()
            self.owner.abort(self.request_id)

    def _finish(self) -> None:
        self.finished = True
        self.owner.streams.pop(self.request_id, None)
        on_finish, self.on_finish = self.on_finish, None
        if on_finish is not None:
            on_finish()


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: Callable[[Sequence[RequestOutput]], None] | None = None,
        own_step_thread: bool = True,
        time_share: TimeShare | None = None,
        on_step_s: Callable[[float], None] | None = None,
    ):
        self.engine = engine
        self.on_step_s = on_step_s  # called in the stepping thread with each step's seconds (metrics)
        self.time_share = time_share  # training's slices between steps (None: serving only)
        self.on_outputs = on_outputs  # called in the stepping thread after each step (metrics)
        # False: the caller runs run_steps() in a thread of its choosing (the main thread; see the module note).
        self.own_step_thread = own_step_thread
        self.streams: dict[str, RequestStream] = {}  # touched only on the event loop thread
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind to the running event loop (call it from there: the app's lifespan), and start the step thread
        unless the caller runs ``run_steps`` itself."""
        self._loop = asyncio.get_running_loop()
        if self.own_step_thread:
            self._thread = threading.Thread(target=self.run_steps, name="alchemist-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Make ``run_steps`` return (after the step in progress), and join the step thread if it is ours."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    # --- requests (event loop thread) ---------------------------------------------------------------------------

    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter_name: str | None = None,
        on_finish: Callable[[], None] | None = None,
    ) -> RequestStream:
        """Admit a request, served by the adapter ``adapter_name`` names (``LLMEngine.add_request``), and return its
        output stream. The engine's ValueError (a request it can never serve) and QueueFullError raise here, before
        anything is streamed (``on_finish`` is then not called; else once, when the stream ends or is closed)."""
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() was not called")
        stream = RequestStream(self, request_id, on_finish)
        self.engine.add_request(request_id, prompt_ids, params, adapter_name)  # raises before the stream is registered
        self.streams[request_id] = stream
        self._wake()
        return stream

    def abort(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.engine.abort(request_id)
        self._wake()  # an abort may need a step to be processed; it also refreshes the stats

    def wake(self) -> None:
        """Look for work now (new feedback for the background worker; any thread)."""
        self._wake()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is not None:  # None: aborted after the step began
                stream.queue.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self.streams.items()):
            stream.queue.put_nowait(error)
            self.engine.abort(request_id)

    # --- the stepping thread -------------------------------------------------------------------------------------

    def run_steps(self) -> None:
        """Step the engine while it has work, run background slices in the gaps, sleep while there is nothing to
        do; return after ``shutdown()``, closing the engine (its record files go; the stepping thread owns it)."""
        try:
            self._step_until_stopped()
        finally:
            self.engine.close()

    def _step_until_stopped(self) -> None:
        while True:
            with self._cond:
                # The check and the wait hold the lock that _wake() takes, so a wake-up cannot slip in between.
                while not self._stopped and not self.engine.has_unfinished() and not self._background_ready():
                    self._cond.wait(timeout=IDLE_POLL_S if self.time_share is not None else None)
                if self._stopped:
                    return
            if not self.engine.has_unfinished():  # serving idle: training takes the machine, slice by slice
                assert self.time_share is not None
                self.time_share.run_slice()
                continue
            t0 = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # keep serving: fail the requests in flight, then carry on
                logger.exception("engine step failed")
                error = EngineDeadError(f"engine step failed: {type(e).__name__}: {e}")
                self._call_soon(self._fail_all, error)
                continue
            if self.on_outputs is not None:
                self.on_outputs(outputs)
            if outputs:
                self._call_soon(self._dispatch, outputs)
            step_s = time.perf_counter() - t0
            if self.on_step_s is not None:
                self.on_step_s(step_s)
            if self.time_share is not None:
                self.time_share.after_step(step_s)

    def _background_ready(self) -> bool:
        return self.time_share is not None and self.time_share.ready()

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed during shutdown
            pass
