"""Small name -> object registries: choices are data (see docs/architecture.md)."""
from typing import Any, Callable, Dict


class Registry:
    """Maps a config string to an object (usually a Flax module class or a function)."""

    def __init__(self, kind: str, config_key: str):
        self.kind = kind
        self.config_key = config_key
        self._entries: Dict[str, Any] = {}

    def register(self, name: str) -> Callable[[Any], Any]:
        def deco(obj):
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = obj
            return obj
        return deco

    def get(self, name: str) -> Any:
        if name not in self._entries:
            raise ValueError(
                f"unknown {self.kind} {name!r} (config key `{self.config_key}`); "
                f"available: {sorted(self._entries)}")
        return self._entries[name]

    def names(self):
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries
