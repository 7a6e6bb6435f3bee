"""Named adapters over HTTP (vLLM's multi-LoRA API): which adapter serves a request's ``model``, who may name which,
their model cards, and the admin's run-time load and unload.

    POST /v1/load_lora_adapter   {"lora_name": "team-a", "lora_path": "/adapters/team-a"}   (admin) -> ModelCard
    POST /v1/unload_lora_adapter {"lora_name": "team-a"}                                      (admin) -> DeletedModel

A request's ``model`` is resolved so:

- the base model's served name (or an alias): the shared adapter, or, for a key with an adapter of its own (the
  keys file's ``adapter``, ``alchemist keys add NAME --adapter team-a``), that adapter: the key's personal model;
- a registered adapter's name: that adapter, when the caller may use it (its own; an admin key any; anyone where
  no keys are configured), else a 403 naming the adapter;
- anything else: the 404 ``model_not_found``.

A response's ``model`` names the adapter that answered it (the base model's served name: the shared adapter), and
/v1/models lists the base model and every adapter the caller may use, each with ``parent`` (the base model's served
name) and ``root`` (its directory), as vLLM's cards have them.

The adapters themselves (on disk, paged into the engine on demand) are ``alchemist.runtime.adapter_registry``'s.
Where the server trains online, each adapter loaded (at start or at run time) is trained from the feedback on its
own responses (``alchemist.runtime.trainers``); else it is served frozen and feedback on its responses is refused
(``alchemist.server.feedback``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from alchemist.model.lora import LoraAdapter
from alchemist.runtime.adapter_registry import AdapterRegistry
from alchemist.server.auth import Caller
from alchemist.server.errors import ModelNotFoundError, NamedAdapterNotFoundError, PermissionDeniedError
from alchemist.server.protocol import DeletedModel, LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest


class NamedAdapters:
    def __init__(self, registry: AdapterRegistry, served_model_names: list[str], max_model_len: int,
                 train: Callable[[str, LoraAdapter], Awaitable[None]] | None = None) -> None:  # fmt: skip
        """``train``: starts a run-time load's trainer (None: loads are served frozen)."""
        self.registry = registry
        self.train = train
        self.served_model_names = served_model_names
        self.base_name = served_model_names[0]
        self.max_model_len = max_model_len

    def resolve(self, model: str, caller: Caller) -> str | None:
        """The adapter that serves a request of ``caller`` for ``model`` (None: the shared one); the module doc
        says how. ModelNotFoundError (404) or PermissionDeniedError (403)."""
        if model in self.served_model_names:
            if caller.adapter is not None and caller.adapter not in self.registry:
                raise ModelNotFoundError(model, self.served_model_names, reason=(
                    f"The model {model!r} is served to key {caller.name!r} by its own adapter {caller.adapter!r}, "
                    "which is not loaded on this server (an admin loads it: --lora-modules or POST "
                    "/v1/load_lora_adapter)"))  # fmt: skip
            return caller.adapter
        if model not in self.registry:
            raise ModelNotFoundError(model, self.served_model_names)
        if not caller.may_use(model):
            raise PermissionDeniedError(f"The key {caller.name!r} may not use the adapter {model!r} (a user key may "
                                        "name only its own adapter)")  # fmt: skip
        return model

    def cards(self, caller: Caller) -> list[ModelCard]:
        """The model cards of the adapters ``caller`` may use, by name."""
        return [self._card(name, str(path)) for name, path in sorted(self.registry.paths().items())
                if caller.may_use(name)]  # fmt: skip

    async def acquire(self, name: str) -> None:
        """Waits until ``name`` is in the engine and holds it there (``release`` when the request is done)."""
        try:
            await self.registry.acquire(name)
        except KeyError:  # unloaded since the request was resolved
            raise ModelNotFoundError(name, self.served_model_names) from None

    def release(self, name: str) -> None:
        self.registry.release(name)

    async def load(self, req: LoadLoRAAdapterRequest) -> ModelCard:
        """Serves the adapter directory ``lora_path`` as the model ``lora_name``; the registry's ValueError (a name
        taken or invalid, a path that holds no adapter this model can serve) is a 400."""
        await self.registry.load(req.lora_name, req.lora_path, self.train)
        return self._card(req.lora_name, req.lora_path)

    def unload(self, req: UnloadLoRAAdapterRequest) -> DeletedModel:
        """Stops serving ``lora_name``; a trained one's ValueError is a 400."""
        try:
            self.registry.unload(req.lora_name)
        except KeyError:
            raise NamedAdapterNotFoundError(req.lora_name, sorted(self.registry.paths())) from None
        return DeletedModel(id=req.lora_name)

    def _card(self, name: str, path: str) -> ModelCard:
        return ModelCard(id=name, root=path, parent=self.base_name, max_model_len=self.max_model_len)
