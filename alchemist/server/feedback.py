"""FeedbackService: a FeedbackRequest -> checked against the served response -> one entry in the feedback log.

The response (and, for a preference, the worse one) is looked up by id in the CompletionsRegistry, and what
training needs (prompt and output ids, adapter version, whether the prompt was recorded) is copied into the entry,
so that the entry stays usable after the registry forgets the response. Every check runs before the write: a
refused request leaves the log untouched.

A submission is first looked up by its idempotency key, so a client retrying after a lost answer gets the entry its
first attempt wrote (``created`` False), even once the response itself has expired.

Kinds: a correction -> "sft" on (prompt, the correction as a reply ending in the end-of-turn id); rating 1 ->
"sft" on (prompt, served output); rating -1 -> "negative"; preferred_over -> "preference".
"""

from __future__ import annotations

from alchemist.feedback.log import FeedbackEntry, FeedbackLog, idempotency_key
from alchemist.model.tokenizer import Tokenizer
from alchemist.server import protocol as p
from alchemist.server.completions_registry import CompletionRecord, CompletionsRegistry
from alchemist.server.errors import InvalidRequestError, ResponseNotFoundError
from alchemist.server.ownership import check_owner


class FeedbackService:
    def __init__(self, log: FeedbackLog, registry: CompletionsRegistry, tokenizer: Tokenizer, max_model_len: int):
        self.log = log
        self.registry = registry
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def submit(self, req: p.FeedbackRequest, owner: str | None = None) -> p.FeedbackResponse:
        """Blocks until the entry is on disk (an fsync): call it from a worker thread, not the event loop.
        ``owner``: the caller's key name, which must be the responses' (None: any response, an admin's or no keys)."""
        check_owner(self.registry, owner, req.response_id, req.preferred_over)
        existing = self.log.find(idempotency_key(req.response_id, req.rating, req.correction, req.preferred_over))
        if existing is not None:
            return _response(existing, created=False)
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
        )
        return _response(entry, created)

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


def _response(entry: FeedbackEntry, created: bool) -> p.FeedbackResponse:
    return p.FeedbackResponse(id=f"fb-{entry.seq}", response_id=entry.response_id, kind=entry.kind, created=created)
