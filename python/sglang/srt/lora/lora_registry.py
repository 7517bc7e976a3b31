"""`LoRARegistry`: the adapters a server serves, by name, on the tokenizer's side (upstream's
`LoRARegistry`): what a request's `lora_path` (a name) or an OpenAI `model` of "base:adapter" resolves
to, and what /load_lora_adapter and /unload_lora_adapter change.

Each loaded adapter has an id of its own (`lora_id`): the scheduler's slots and the prefix cache key by
it, so an adapter unloaded and loaded again under the same name (new weights) never meets the old one's
cached prefixes or requests. Unloading removes the name at once: requests sent before still run with it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.request_error import RequestError

# Upstream's words for a request that names an adapter while LoRA is off (after the field's name).
NOT_ENABLED = "{field} names LoRA adapter {name!r}, but LoRA is not enabled (start the server with --enable-lora)."


@dataclass(frozen=True)
class LoadedAdapter:
    lora_id: str
    lora_path: str
    pinned: bool = False


class LoRARegistry:
    def __init__(self, server_args: Any):
        self.enabled = bool(server_args.enable_lora)
        self.served_model_name = server_args.served_model_name
        self.adapters: dict[str, LoadedAdapter] = {
            ref.lora_name: LoadedAdapter(ref.lora_id, ref.lora_path, ref.pinned)
            for ref in server_args.lora_refs
        }

    def resolve(self, name: Any, field: str = "lora_path") -> str | None:
        """The id of adapter `name` (None: the base model); RequestError naming `field` otherwise."""
        if name is None or name == "":
            return None
        if not isinstance(name, str):
            raise RequestError(f"{field} must be an adapter's name (a string) or null.", field, "invalid_type")
        if not self.enabled:
            raise RequestError(NOT_ENABLED.format(field=field, name=name), field)
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise RequestError(f"{field} names LoRA adapter {name!r}, which is not loaded (loaded: {loaded}).", field, "model_not_found")
        return adapter.lora_id

    def split_model(self, model: Any) -> tuple[str | None, str | None]:
        """An OpenAI `model` of "base:adapter" (upstream's form) as (base, adapter); a plain name that is
        an adapter's, as (None, adapter); anything else as (model, None)."""
        if not isinstance(model, str):
            return None, None
        base, sep, adapter = model.partition(":")
        if sep and self.enabled:
            return base, adapter
        if self.enabled and model in self.adapters:
            return None, model
        return model, None

    def loaded(self) -> dict[str, str]:
        """Upstream's `loaded_adapters`: name -> path."""
        return {name: a.lora_path for name, a in sorted(self.adapters.items())}

    # ---- load and unload (the scheduler's reply decides) -----------------------------------------

    def new_id(self, name: str) -> str:
        return f"{name}:{uuid.uuid4().hex}"

    def add(self, name: str, lora_id: str, path: str, pinned: bool) -> None:
        self.adapters[name] = LoadedAdapter(lora_id, path, pinned)

    def remove(self, name: str) -> LoadedAdapter | None:
        return self.adapters.pop(name, None)


def parse_load_lora_adapter(body: Any) -> Any:
    """A /load_lora_adapter body (upstream's): lora_name, lora_path, pinned (default false)."""
    from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

    name, path = _name(body), body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise RequestError("lora_path must be the adapter's folder.", "lora_path", "invalid_type")
    pinned = body.get("pinned", False)
    if not isinstance(pinned, bool):
        raise RequestError("pinned must be true or false.", "pinned", "invalid_type")
    return LoadLoRAAdapterReqInput(name, path, pinned)


def parse_unload_lora_adapter(body: Any) -> Any:
    from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

    return UnloadLoRAAdapterReqInput(_name(body))


def _name(body: Any) -> str:
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.", None, "invalid_type")
    name = body.get("lora_name")
    if not isinstance(name, str) or not name or ":" in name:
        raise RequestError("lora_name must be a non-empty name without ':'.", "lora_name", "invalid_type")
    return name
