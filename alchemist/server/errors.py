"""Exceptions the HTTP layer raises; ``alchemist.server.app`` maps each one to a status code in one table.

They carry no HTTP knowledge. Anything else that is a ``ValueError`` (the engine's impossible-request errors,
the tokenizer's message checks) is a 400 too, and the engine's QueueFullError a 429.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request we refuse; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelNotFoundError(LookupError):
    def __init__(self, model: str, served: list[str], reason: str | None = None):
        # Only the public name: the other accepted names are paths on the server's disk, nobody else's business.
        super().__init__(reason or f"The model {model!r} does not exist; this server serves {served[0]!r}")
        self.param = "model"


class ResponseNotFoundError(LookupError):
    """Feedback names a response id this server does not know (never served, or expired from the registry)."""

    def __init__(self, response_id: str, param: str):
        super().__init__(
            f"No response with id {response_id!r}: it was never served here or has expired "
            "(ServerConfig.max_completions_kept, completion_ttl_s)"
        )
        self.param = param


class BodyTooLargeError(ValueError):
    def __init__(self, limit_bytes: int):
        super().__init__(f"Request body exceeds the limit of {limit_bytes} bytes (ServerConfig.max_body_bytes)")


class AdapterNotFoundError(LookupError):
    """A rollback names an adapter version that is not (or no longer) kept."""

    def __init__(self, version: int, kept: list[int]):
        super().__init__(
            f"No adapter version {version} to roll back to; kept: {kept or 'none'} (0 is the base model; "
            "OnlineConfig.adapter.keep_versions sets how many are kept)"
        )
        self.param = "version"


class TrainingDisabledError(ValueError):
    def __init__(self) -> None:
        super().__init__("online training is disabled on this server (start it without --no-train)")


class AuthenticationError(PermissionError):
    """No API key, or one that is not configured (401)."""

    headers = {"WWW-Authenticate": "Bearer"}


class PermissionDeniedError(PermissionError):
    """A valid key that may not do this: a user key on an admin route, feedback on another key's response (403)."""


class RateLimitError(RuntimeError):
    """A key's rate limit is spent (429); ``retry_after_s`` says when the next request would be admitted."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.headers = {"Retry-After": str(max(1, int(retry_after_s + 0.999)))}


class FeedbackNotFoundError(LookupError):
    """GET /v1/feedback/{id} names no entry (neither a server id "fb-<seq>" nor a client's feedback_id)."""

    def __init__(self, feedback_id: str):
        super().__init__(f"No feedback with id {feedback_id!r} (an id fb-<seq> from POST /v1/feedback, or the "
                         "feedback_id a client sent)")  # fmt: skip
        self.param = "id"


class FeedbackConflictError(ValueError):
    """A client's feedback_id already names an entry with different content."""

    def __init__(self, feedback_id: str, seq: int):
        super().__init__(
            f"feedback_id {feedback_id!r} already names feedback fb-{seq} with different content; a retry must send "
            "the same fields, new feedback a new feedback_id"
        )
        self.param = "feedback_id"


class NamedAdapterNotFoundError(LookupError):
    """/v1/unload_lora_adapter names no loaded adapter, or /v1/adapters no trained one (404)."""

    def __init__(self, name: str, loaded: list[str], param: str = "lora_name", what: str = "loaded"):
        super().__init__(f"No LoRA adapter named {name!r} is {what} ({what}: {', '.join(loaded) or 'none'})")
        self.param = param


class AdapterNotTrainedError(ValueError):
    """Feedback on a response of a named adapter that nothing trains here (409)."""

    def __init__(self, adapter: str, param: str):
        super().__init__(
            f"The response was served by the named adapter {adapter!r}, which is served frozen (this server trains "
            "no named adapter: --no-train, or replicas); nothing was logged"
        )
        self.param = param
