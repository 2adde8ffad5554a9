"""Path patterns: how a dialect (or an HTTP route) says which request paths are its own.

Three forms, from most to least specific:

```text
/gateway/websocket     exact       that path only
/relay/*               prefix      the path and everything below it (/relay, /relay/a/b)
/{key}                 segment     exactly one non-empty segment (/abc, not / nor /a/b)
```

The listener and the HTTP router pick the most specific pattern that matches: an exact path
beats any prefix, a longer prefix beats a shorter one, and a one-segment wildcard loses to both.
Two owners declaring the same pattern is a configuration error, refused at startup.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

from rmb_relay.errors import ConfigError


class PathKind(enum.IntEnum):
    """Ordered by specificity (higher wins)."""

    SEGMENT = 0
    PREFIX = 1
    EXACT = 2


@dataclass(frozen=True, slots=True)
class PathPattern:
    kind: PathKind
    #: the exact path, the prefix without `/*`, or "" for a segment pattern
    path: str
    #: the pattern as written, for messages
    text: str

    @classmethod
    def parse(cls, text: str) -> PathPattern:
        if not text.startswith("/"):
            raise ConfigError(f"path pattern {text!r} must start with /")
        if text.endswith("/*"):
            prefix = text[:-2]
            if "*" in prefix or "{" in prefix:
                raise ConfigError(f"path pattern {text!r}: only a trailing /* is a wildcard")
            return cls(PathKind.PREFIX, prefix, text)
        if text.startswith("/{") and text.endswith("}") and text.count("/") == 1:
            return cls(PathKind.SEGMENT, "", text)
        if "*" in text or "{" in text:
            raise ConfigError(f"path pattern {text!r}: use /exact, /prefix/* or /{{segment}}")
        return cls(PathKind.EXACT, text, text)

    def matches(self, path: str) -> bool:
        kind = self.kind
        if kind is PathKind.EXACT:
            return path == self.path
        if kind is PathKind.PREFIX:
            prefix = self.path
            return (
                path == prefix
                or path.startswith(prefix + "/")
                or (prefix == "" and path.startswith("/"))
            )
        return len(path) > 1 and path.count("/") == 1

    @property
    def rank(self) -> tuple[int, int]:
        """Sort key: most specific first when sorted in reverse."""
        return (int(self.kind), len(self.path))


T = TypeVar("T")


class PathTable(Generic[T]):
    """Patterns to owners; `find` returns the owner of the most specific matching pattern."""

    def __init__(self) -> None:
        self._entries: list[tuple[PathPattern, T]] = []
        self._exact: dict[str, T] = {}

    def add(self, pattern: PathPattern | str, owner: T, *, describe: str = "") -> None:
        if isinstance(pattern, str):
            pattern = PathPattern.parse(pattern)
        for existing, _ in self._entries:
            if existing.kind is pattern.kind and existing.path == pattern.path:
                raise ConfigError(
                    f"path {pattern.text} is claimed twice{f' ({describe})' if describe else ''}"
                )
        self._entries.append((pattern, owner))
        self._entries.sort(key=lambda item: item[0].rank, reverse=True)
        if pattern.kind is PathKind.EXACT:
            self._exact[pattern.path] = owner

    def find(self, path: str) -> T | None:
        owner = self._exact.get(path)
        if owner is not None:
            return owner
        for pattern, candidate in self._entries:
            if pattern.matches(path):
                return candidate
        return None

    def patterns(self) -> list[tuple[PathPattern, T]]:
        return list(self._entries)
