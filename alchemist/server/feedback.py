"""FeedbackService: a FeedbackRequest -> checked against the served response -> one entry in the feedback log.

The response (and, for a preference, the worse one) is looked up by id in the CompletionsRegistry, and what
training needs (prompt and output ids, adapter version, whether the prompt was recorded) is copied into the entry,
so that the entry stays usable after the registry forgets the response. Every check runs before the write: a
refused request leaves the log untouched.

A submission is first looked up by its idempotency key, so a client retrying after a lost answer gets the entry its
first attempt wrote (``created`` False), even once the response itself has expired. A client that sends its own
``feedback_id`` makes that id the key: a retry finds the entry by it (and must send the same fields: other content
under a used id is a 409), and ``GET /v1/feedback/{feedback_id}`` answers as ``GET /v1/feedback/fb-<seq>`` does.
``comment`` and ``metadata`` are kept with the entry and shown, never trained on.

Feedback trains the adapter that served the response, never another: the entry names it (``adapter``; None: the
shared one), and that adapter's trainer alone reads it (``alchemist.runtime.trainers``). On a response of a named
adapter that nothing trains here (``alchemist.server.named_adapters``: served frozen, where the server does not
train named adapters) it is refused with a 409 ``adapter_not_trained``, and nothing is logged; a preference pair
names two responses of one adapter.

Kinds: a correction -> "sft" on (prompt, the correction as a reply ending in the end-of-turn id); rating 1 ->
"sft" on (prompt, served output); rating -1 -> "negative"; preferred_over -> "preference".
"""

from __future__ import annotations

from collections.abc import Container

from alchemist.feedback.log import FeedbackEntry, FeedbackLog, idempotency_key
from alchemist.feedback.schema import STATES
from alchemist.model.tokenizer import Tokenizer
from alchemist.server import protocol as p
from alchemist.server.completions_registry import CompletionRecord, CompletionsRegistry
from alchemist.server.errors import (
    AdapterNotTrainedError,
    FeedbackConflictError,
    FeedbackNotFoundError,
    InvalidRequestError,
    ResponseNotFoundError,
)
from alchemist.server.ownership import check_owner

MAX_LIST = 1000  # entries in one GET /v1/feedback


class FeedbackService:
    def __init__(self, log: FeedbackLog, registry: CompletionsRegistry, tokenizer: Tokenizer, max_model_len: int,
                 trained: Container[str] = ()) -> None:  # fmt: skip
        """``trained``: the named adapters trained here, whose responses take feedback."""
        self.log = log
        self.trained = trained
        self.registry = registry
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def submit(
        self, req: p.FeedbackRequest, owner: str | None = None, key_name: str | None = None
    ) -> p.FeedbackResponse:
        """Blocks until the entry is on disk (an fsync): call it from a worker thread, not the event loop.
        ``owner``: the caller's key name, which must be the responses' (None: any response, an admin's or no keys);
        ``key_name``: the caller's key, logged with the entry (the trainer caps each key's share of a batch)."""
        check_owner(self.registry, owner, req.response_id, req.preferred_over)
        self._check_trained(req.response_id, "response_id")
        self._check_trained(req.preferred_over, "preferred_over")
        key = idempotency_key(
            req.response_id, req.rating, req.correction, req.preferred_over, req.comment, req.metadata, req.feedback_id
        )
        existing = self.log.find(key)
        if existing is not None:
            return self._repeat(existing, req)
        record = self._lookup(req.response_id, "response_id")
        rejected = None
        if req.preferred_over is not None:
            kind, response_ids = "preference", record.output_token_ids
            rejected = self._worse_response(req.preferred_over, record).output_token_ids
        elif req.correction is not None:
            kind, response_ids = "sft", self._correction_ids(req.correction, record)
        elif req.rating == 1:
            kind, response_ids = "sft", record.output_token_ids
        else:
            kind, response_ids = "negative", record.output_token_ids
        entry, created = self.log.append(
            response_id=record.id,
            kind=kind,
            rating=req.rating,
            correction=req.correction,
            preferred_over=req.preferred_over,
            prompt_token_ids=record.prompt_token_ids,
            response_token_ids=response_ids,
            output_token_ids=record.output_token_ids,
            rejected_token_ids=rejected,
            adapter_version=record.adapter_version,
            recorded=record.recorded,
            comment=req.comment,
            feedback_id=req.feedback_id,
            metadata=req.metadata,
            key_name=key_name,
            adapter=record.adapter_name,
        )
        return self._repeat(entry, req) if not created else _response(entry, created)

    def get(self, feedback_id: str, owner: str | None = None) -> p.FeedbackInfo:
        """An entry and its state, by the server's id ("fb-<seq>") or the client's ``feedback_id``; ``owner`` as
        for ``submit`` (an entry on another key's response is a 403 while the server still knows the response)."""
        entry = None
        if p.SERVER_FEEDBACK_ID.fullmatch(feedback_id):
            entry = self.log.get(int(feedback_id[3:]))
        else:
            entry = self.log.find(feedback_id=feedback_id)
        if entry is None:
            raise FeedbackNotFoundError(feedback_id)
        check_owner(self.registry, owner, entry.response_id)
        return _info(entry)

    def entries(self, state: str | None, after: str | None, limit: int) -> p.FeedbackList:
        """Entries (in ``state``) after the entry ``after`` ("fb-<seq>"), oldest first, and the backlog."""
        if state is not None and state not in STATES:
            raise InvalidRequestError(f"state must be one of {', '.join(STATES)} (got {state!r})", "state")
        if after is not None and not p.SERVER_FEEDBACK_ID.fullmatch(after):
            raise InvalidRequestError(f"after must be a feedback id fb-<seq> (got {after!r})", "after")
        if not 1 <= limit <= MAX_LIST:
            raise InvalidRequestError(f"limit must be in 1..{MAX_LIST} (got {limit})", "limit")
        entries = self.log.read(int(after[3:]) if after else 0, limit + 1, state)
        backlog = {kind: p.BacklogClass(count=n, oldest_created_at=None if oldest is None else int(oldest))
                   for kind, (n, oldest) in self.log.backlog().items()}  # fmt: skip
        return p.FeedbackList(data=[_info(e) for e in entries[:limit]], has_more=len(entries) > limit, backlog=backlog)

    @staticmethod
    def _repeat(entry: FeedbackEntry, req: p.FeedbackRequest) -> p.FeedbackResponse:
        """The answer to a submission already logged: that entry, unless a client's feedback_id is reused for
        other content."""
        sent = (req.response_id, req.rating, req.correction, req.preferred_over, req.comment, req.metadata)
        logged = (entry.response_id, entry.rating, entry.correction, entry.preferred_over, entry.comment,
                  entry.metadata)  # fmt: skip
        if req.feedback_id is not None and sent != logged:
            raise FeedbackConflictError(req.feedback_id, entry.seq)
        return _response(entry, created=False)

    def _check_trained(self, response_id: str | None, param: str) -> None:
        """AdapterNotTrainedError if a named adapter that nothing trains here served the response: no other adapter
        may learn from it. Unknown ids pass: the lookup answers them with its 404."""
        record = self.registry.get(response_id) if response_id is not None else None
        if record is not None and record.adapter_name is not None and record.adapter_name not in self.trained:
            raise AdapterNotTrainedError(record.adapter_name, param)

    def _lookup(self, response_id: str, param: str) -> CompletionRecord:
        record = self.registry.get(response_id)
        if record is None:
            raise ResponseNotFoundError(response_id, param)
        return record

    def _worse_response(self, response_id: str, better: CompletionRecord) -> CompletionRecord:
        if response_id == better.id:
            raise InvalidRequestError(
                "preferred_over must name a different response than response_id", "preferred_over"
            )
        worse = self._lookup(response_id, "preferred_over")
        if worse.adapter_name != better.adapter_name:  # a pair trains one adapter: both answers must be its own
            raise InvalidRequestError(
                f"preferred_over ({response_id!r}) was served by another adapter than response_id ({better.id!r})",
                "preferred_over",
            )
        if worse.prompt_token_ids != better.prompt_token_ids:
            # A preference pair compares two answers to one prompt; across prompts it teaches nothing.
            raise InvalidRequestError(
                f"preferred_over ({response_id!r}) answered a different prompt than response_id ({better.id!r})",
                "preferred_over",
            )
        return worse

    def _correction_ids(self, correction: str, record: CompletionRecord) -> list[int]:
        ids = self.tokenizer.encode_reply(correction)
        total = len(record.prompt_token_ids) + len(ids)
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"The correction is {len(ids)} tokens; with the {len(record.prompt_token_ids)} prompt tokens that is "
                f"{total}, beyond the context of {self.max_model_len} tokens (max_model_len)",
                "correction",
            )
        return ids


def _info(entry: FeedbackEntry) -> p.FeedbackInfo:
    return p.FeedbackInfo(
        id=f"fb-{entry.seq}",
        response_id=entry.response_id,
        kind=entry.kind,
        rating=entry.rating,
        comment=entry.comment,
        metadata=entry.metadata,
        feedback_id=entry.feedback_id,
        created_at=int(entry.created_s),
        state=entry.state,
        trained_version=entry.trained_version,
        skip_reason=entry.skip_reason,
        quarantine_reason=entry.quarantine_reason,
    )


def _response(entry: FeedbackEntry, created: bool) -> p.FeedbackResponse:
    return p.FeedbackResponse(**_info(entry).model_dump(), created=created)
