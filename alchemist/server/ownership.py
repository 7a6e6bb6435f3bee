"""A response belongs to the API key that made it: feedback on it (and on the response it is preferred over) is
that key's, or an admin's. The CompletionsRegistry keeps each response's owner (the key's name)."""

from __future__ import annotations

from alchemist.server.completions_registry import CompletionsRegistry
from alchemist.server.errors import PermissionDeniedError


def check_owner(registry: CompletionsRegistry, owner: str | None, *response_ids: str | None) -> None:
    """Raise PermissionDeniedError if a response of ``response_ids`` belongs to another key than ``owner`` (None:
    no check). Unknown ids pass: the caller answers them with its 404."""
    if owner is None:
        return
    for response_id in response_ids:
        record = registry.get(response_id) if response_id is not None else None
        if record is not None and record.owner is not None and record.owner != owner:
            raise PermissionDeniedError(f"The response {response_id!r} was made with another API key")
