"""OpenAI wire format: pydantic models for /v1/chat/completions, /v1/completions, /v1/models and errors, plus
Alchemist's own /v1/feedback.

Requests accept what the official ``openai`` client sends. Fields we do not implement are ignored (as vLLM
does), except ``n`` > 1 and ``echo``/``suffix``/``best_of``, which change the answer's shape and are refused.
Extras beyond OpenAI: ``top_k``, ``ignore_eos``, ``min_tokens`` (vLLM's: no EOS, stop token or stop string ends
the answer before that many tokens; at most ``max_tokens``) and ``alchemist: {"record": bool}`` (send them with
the client's ``extra_body``).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_LOGPROBS = 20
MAX_COMMENT_CHARS = 10_000
MAX_FEEDBACK_ID_CHARS = 256
MAX_METADATA_BYTES = 16_384
SERVER_FEEDBACK_ID = re.compile(r"fb-\d+")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def fingerprint(adapter_version: int) -> str:
    """OpenAI's ``system_fingerprint`` names the backend configuration that answered: here the adapter version
    (``alchemist-v0``: the base model), which is what changes as the server learns."""
    return f"alchemist-v{adapter_version}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- errors ---------------------------------------------------------------------------------------------------


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# --- requests -------------------------------------------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class AlchemistOptions(OpenAIModel):
    record: bool = False  # keep this request's activations for training on later feedback


class SamplingRequest(OpenAIModel):
    """The fields chat and text completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)  # <= max_tokens: checked by the service, which knows both
    alchemist: AlchemistOptions = Field(default_factory=AlchemistOptions)

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict a chat template takes (text parts joined, developer as system)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """None: no logprobs; k >= 0: the chosen token's logprob plus the k most likely alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    # One prompt: a string or token ids (a list of one of either is accepted too).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1] | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


# --- responses ------------------------------------------------------------------------------------------------


class UsageInfo(OpenAIModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class ChatCompletionMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(OpenAIModel):
    index: int = 0
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class ChatDelta(OpenAIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}  # OpenAI sends {} as the last delta


class ChatCompletionStreamChoice(OpenAIModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None  # always set on full responses; None in stream chunks


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "alchemist"
    root: str | None = None  # vLLM's: a named adapter's directory (the base model's path is not shown)
    parent: str | None = None  # vLLM's: a named adapter's base model (its served name); None for the base model
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's POST /v1/load_lora_adapter: serve the PEFT adapter directory ``lora_path`` as the model
    ``lora_name``."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    """vLLM's POST /v1/unload_lora_adapter (``lora_int_id`` is accepted and ignored, as names are unique)."""

    lora_name: str
    lora_int_id: int | None = None


class DeletedModel(OpenAIModel):
    """What an unload answers (OpenAI's shape for a deleted model)."""

    id: str
    object: Literal["model"] = "model"
    deleted: bool = True


# --- feedback (Alchemist's own endpoint) ----------------------------------------------------------------------


class FeedbackRequest(BaseModel):
    """Feedback on one response, by the ``id`` it was served with. ``correction``: how the response should have
    read (trained on instead of it); ``preferred_over``: the id of a worse response to the same prompt."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field would otherwise be silently lost feedback

    response_id: str = Field(min_length=1)
    rating: Literal[1, -1] | None = None
    correction: str | None = None
    preferred_over: str | None = None
    # What feedback tools send beside (LangSmith, Langfuse, Open WebUI): kept and shown, never trained on.
    comment: str | None = Field(default=None, max_length=MAX_COMMENT_CHARS)
    feedback_id: str | None = Field(default=None, min_length=1, max_length=MAX_FEEDBACK_ID_CHARS)  # idempotency
    metadata: dict[str, Any] | None = None  # any JSON object, at most MAX_METADATA_BYTES as compact JSON

    @field_validator("feedback_id")
    @classmethod
    def _feedback_id_is_not_ours(cls, feedback_id: str | None) -> str | None:
        # GET /v1/feedback/{id} takes either kind of id: a client's must not look like the server's "fb-<seq>".
        if feedback_id is not None and SERVER_FEEDBACK_ID.fullmatch(feedback_id):
            raise ValueError("feedback_id must not have the form fb-<number> (the server's own ids)")
        return feedback_id

    @field_validator("metadata")
    @classmethod
    def _metadata_is_small(cls, metadata: dict[str, Any] | None) -> dict[str, Any] | None:
        if metadata is not None:
            size = len(json.dumps(metadata, ensure_ascii=False, separators=(",", ":")).encode())
            if size > MAX_METADATA_BYTES:
                raise ValueError(f"metadata is {size} bytes as JSON; at most {MAX_METADATA_BYTES} are kept")
        return metadata

    @field_validator("rating", mode="before")
    @classmethod
    def _rating_is_an_integer(cls, rating: object) -> object:
        # pydantic's Literal[1, -1] would take true and 1.0 as 1; a rating is exactly 1 or -1
        if rating is not None and (isinstance(rating, bool) or not isinstance(rating, int)):
            raise ValueError("rating must be 1, -1 or null")
        return rating

    @field_validator("correction")
    @classmethod
    def _correction_has_text(cls, correction: str | None) -> str | None:
        if correction is not None and not correction.strip():
            raise ValueError("correction must not be empty")
        return correction

    @model_validator(mode="after")
    def _says_something(self) -> FeedbackRequest:
        if self.rating is None and self.correction is None and self.preferred_over is None:
            raise ValueError("feedback needs at least one of rating, correction or preferred_over")
        if self.preferred_over is not None and (self.rating is not None or self.correction is not None):
            # One submission, one entry of one kind; a rating or correction is a separate submission.
            raise ValueError("preferred_over cannot be combined with rating or correction; send them separately")
        return self


class FeedbackInfo(OpenAIModel):
    """An entry of the feedback log and what became of it: GET /v1/feedback/{id}."""

    id: str  # "fb-<seq>": the entry's position in the feedback log
    object: Literal["feedback"] = "feedback"
    response_id: str
    kind: Literal["sft", "negative", "preference"]
    rating: int | None
    comment: str | None
    metadata: dict[str, Any] | None
    feedback_id: str | None  # the client's id, if it sent one (GET /v1/feedback/{feedback_id} finds it too)
    created_at: int  # unix seconds of the append
    state: Literal["queued", "trained", "skipped", "quarantined"]
    trained_version: int | None  # the adapter version whose training step learned it ("trained")
    skip_reason: str | None  # why it will not be trained ("skipped")
    quarantine_reason: str | None  # why the poisoning guard held it ("quarantined"; kept once released)


class BacklogClass(OpenAIModel):
    count: int  # queued entries of this class
    oldest_created_at: int | None  # unix seconds of the oldest one's arrival


class FeedbackList(OpenAIModel):
    """GET /v1/feedback: entries oldest first (filtered by state), and the backlog by class."""

    object: Literal["list"] = "list"
    data: list[FeedbackInfo]
    has_more: bool  # more entries after the last one here (ask again with after=<its id>)
    backlog: dict[str, BacklogClass]  # "correction", "thumbs_up", "thumbs_down", "preference"


class FeedbackResponse(FeedbackInfo):
    """POST /v1/feedback's answer: the entry, and whether this request wrote it."""

    created: bool  # False: the same feedback was already logged (this is that entry)


# --- adapters (Alchemist's own endpoints) ---------------------------------------------------------------------


class AdapterInfo(OpenAIModel):
    id: str  # "v<version>"
    object: Literal["adapter"] = "adapter"
    version: int
    created: int
    serving: bool  # the version the engine serves now
    log_position: int  # the feedback log's seq up to which this version has trained
    # False: the evaluation gate kept it from serving (metrics["evaluation"]["reason"] says why); a rollback to it
    # serves it anyway (an admin's call).
    promoted: bool = True
    metrics: dict[str, Any]  # its training step's loss, samples, tokens, evaluation, ... (or {"rollback_of": v})


class AdapterList(OpenAIModel):
    object: Literal["list"] = "list"
    serving_version: int  # 0: the base model
    training: bool  # whether the online trainer runs
    data: list[AdapterInfo]


class AdapterSummary(OpenAIModel):
    """GET /v1/adapters/summary: one adapter at a glance (the dashboard's row for it)."""

    adapter: str | None  # a named adapter's name; None: the shared adapter
    object: Literal["adapter.summary"] = "adapter.summary"
    # The version it serves (0: the shared adapter's base model); None: a named adapter nothing trains here, served
    # from its directory (its model card's ``root``) with no versions of its own.
    serving_version: int | None
    # "on": its trainer runs; "frozen": the server trains, but not this named adapter (replicas train the shared
    # one only); "off": the server trains nothing (--no-train).
    training: Literal["on", "frozen", "off"]
    backlog: int  # its feedback entries queued for training
    # Where its weights are: "engine" (served without a wait: the shared adapter and trained ones always),
    # "memory" (read, paged into the engine on its next request), "disk" (read from its directory then).
    residence: Literal["engine", "memory", "disk"]


class AdapterSummaryList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[AdapterSummary]  # the shared adapter first, then the named ones the caller may use, by name


class RollbackRequest(BaseModel):
    """Serve an earlier adapter version again (0: the base model). It is published as a new version."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)
    adapter: str | None = None  # a named adapter's versions (None: the shared adapter's)
