"""The quarantine's admin endpoints: feedback the poisoning guard kept out of training, and its release.

    GET  /v1/quarantine                         -> {"object": "list", "data": [{"seq", "response_id", "reason",
                                                    "loss", "held_at", "released"}, ...]}
    POST /v1/quarantine/release {"seqs": [12]}  -> the same list, after the release (released entries train next)

Held is a state of the entry in the feedback log ("quarantined", shown by GET /v1/feedback/{id} too), so it lasts
across restarts; released entries are queued again, first in line, and listed until trained. The view is the
online trainer's (``alchemist.training.quarantine``); without training there is none.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from alchemist.server.auth import Caller, admin
from alchemist.server.errors import TrainingDisabledError
from alchemist.server.openapi import errors

router = APIRouter()


class QuarantineList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]


class ReleaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # feedback log positions (the "fb-<seq>" ids), within SQLite's integers
    seqs: list[Annotated[int, Field(ge=1, le=2**63 - 1)]] = Field(min_length=1, max_length=10_000)


@router.get("/v1/quarantine", responses=errors(401, 403))
def quarantine(request: Request, caller: Caller = Depends(admin)) -> QuarantineList:
    trainer = request.app.state.trainer
    return QuarantineList(data=trainer.quarantine.list() if trainer is not None else [])


@router.post("/v1/quarantine/release", responses=errors(400, 401, 403, 413))
def release(body: ReleaseRequest, request: Request, caller: Caller = Depends(admin)) -> QuarantineList:
    trainer = request.app.state.trainer
    if trainer is None:
        raise TrainingDisabledError()
    trainer.quarantine.release(body.seqs)  # the log's state changes at once (a write of its own, durable)
    request.app.state.async_engine.wake()  # the trainer may have a batch now
    return QuarantineList(data=trainer.quarantine.list())
