"""Where bodies over the inline limit wait between the client and the connector (decision 5).

Files `req_{id}` and `res_{id}` in one directory, as RelayServer's FileBodyStore, written and
read in `CHUNK` pieces so a body of any size costs one chunk of memory. Unlike RelayServer's
store it keeps track of what it wrote and sweeps: a file whose request is over and that nobody
removed (the client went away mid-download, a connector never fetched its body; RelayServer's
issue #271) is deleted once it is older than `max_age`, and files left by an earlier run are
deleted at startup once they are that old.

Anyone who can reach a tenant without required authentication can upload, so the store is
bounded while a body streams, not after: one body at most `max_body` bytes, one tenant's files
and all files under a `ByteBudget` (budget.py) of disk bytes; the write that would pass a bound
stops there, its file is removed and `BodyTooLarge` names the bound (413). The directory is
private: created 0700, refused when another user owns it or others may write to it; files 0600.

Writes and the removal of a refused upload run in one thread of the store's own, not on the
event loop: a write is usually a copy into the page cache (tens of microseconds), but under a
sustained upload flood the kernel throttles writers of dirty pages and a write or an unlink
blocks for milliseconds (`bench.hardening upload-flood-1g`: honest p99 25 ms with them on the
loop, on ext4). One thread keeps the disk work in order and never takes more than one core.
Reads, and removals of finished bodies, stay on the loop: they copy from the page cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import stat
from collections.abc import AsyncIterable, AsyncIterator, Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rmb_relay.budget import ByteBudget
from rmb_relay.clock import Clock, monotonic_clock, nanos
from rmb_relay.errors import BodyTooLarge, ConfigError

__all__ = ["CHUNK", "FileBodyStore"]

#: bytes read from a body file per step
CHUNK = 256 * 1024
_NAME = re.compile(r"(req|res)_[0-9a-f-]{32,36}")
#: a body file is this user's alone
_FILE_MODE = 0o600
_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)

log = logging.getLogger("rmb_relay.tunnel")


def private_directory(directory: Path) -> None:
    """Make `directory` (0700) or check that it is private: owned by this user and not
    writable by anyone else (a directory someone else made first could be read or filled by
    them). A directory of ours that others may only read is tightened to 0700."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
        info = directory.lstat()
    except OSError as err:
        raise ConfigError(f"body store {directory}: {err}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"body store {directory} is not a directory")
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"body store {directory} belongs to uid {info.st_uid}, not this relay's user "
            f"({os.geteuid()}): choose a directory of ours with --tunnel-body-store"
        )
    if info.st_mode & 0o022:
        raise ConfigError(
            f"body store {directory} may be written by others (mode {info.st_mode & 0o777:o}): "
            "make it 0700 or choose another with --tunnel-body-store"
        )
    if info.st_mode & 0o077:
        log.warning("tunnel: body store %s was readable by others; made it 0700", directory)
        directory.chmod(0o700)


class FileBodyStore:
    """Body files in `directory`, each charged to its owner (a tenant key) in `disk`.
    `sweep(now)` removes tracked files older than `max_age`."""

    def __init__(
        self,
        directory: str | Path,
        *,
        max_age: float,
        clock: Clock = monotonic_clock,
        max_body: int = 1 << 30,
        tenant_bytes: int = 2 << 30,
        total_bytes: int = 8 << 30,
    ) -> None:
        self.directory = Path(directory)
        self.max_age = nanos(max_age)
        self.clock = clock
        self.max_body = max_body
        #: disk bytes of tracked files, per owner and in all
        self.disk = ByteBudget(key_bytes=tenant_bytes, total_bytes=total_bytes)
        #: file name -> when it was created (clock)
        self._files: dict[str, int] = {}
        #: file name -> (owner, bytes charged)
        self._sizes: dict[str, tuple[str, int]] = {}
        #: bodies refused by the bound they would have passed ("body", "tenant", "total")
        self.refused: dict[str, int] = {"body": 0, "tenant": 0, "total": 0}
        #: the thread body writes run in (made at the first write)
        self._io: ThreadPoolExecutor | None = None
        private_directory(self.directory)
        try:
            probe = self.directory / ".probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"body store {self.directory} is not writable: {err}") from None

    @staticmethod
    def name(kind: str, request_id: str) -> str:
        return f"{kind}_{request_id}"

    def path(self, name: str) -> Path:
        if not _NAME.fullmatch(name):
            raise ValueError(f"not a body file name: {name!r}")
        return self.directory / name

    def exists(self, name: str) -> bool:
        return name in self._files and self.path(name).exists()

    @property
    def held(self) -> int:
        """Bytes held in tracked files."""
        return self.disk.held

    def size(self, name: str) -> int:
        entry = self._sizes.get(name)
        return entry[1] if entry is not None else 0

    def refuse_size(self, size: int) -> None:
        """BodyTooLarge when a body of `size` bytes (a Content-Length) is over `max_body`:
        refused before a byte is read."""
        if size > self.max_body:
            self.refused["body"] += 1
            raise BodyTooLarge("body", self.max_body)

    async def write(
        self, name: str, chunks: AsyncIterable[bytes], first: bytes = b"", *, owner: str = ""
    ) -> int:
        """Store `first` then every chunk, charged to `owner`; returns the size. A failed
        write leaves no file; one that would pass a bound raises BodyTooLarge."""
        path = self.path(name)
        loop = asyncio.get_running_loop()
        if self._io is None:
            self._io = ThreadPoolExecutor(1, thread_name_prefix="rmb-bodies")
        io = self._io
        self._track(name, owner, 0)
        written = 0
        try:
            with os.fdopen(os.open(path, _OPEN_FLAGS, _FILE_MODE), "wb") as out:
                if first:
                    self._grow(name, len(first))
                    await loop.run_in_executor(io, out.write, first)
                    written += len(first)
                async for chunk in chunks:
                    self._grow(name, len(chunk))
                    await loop.run_in_executor(io, out.write, chunk)
                    written += len(chunk)
        except BaseException:
            self.release(name)
            # gone before the refusal is answered; a second cancellation does not stop it
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(loop.run_in_executor(io, self._unlink, path))
            raise
        return written

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    async def read(self, name: str, *, remove: bool = False) -> AsyncIterator[bytes]:
        """The file's bytes in chunks; removed afterwards (also when the reader stops early)
        if `remove`."""
        try:
            with self.path(name).open("rb") as source:
                while chunk := source.read(CHUNK):
                    yield chunk
        finally:
            if remove:
                self.remove(name)

    def adopt(self, name: str, size: int, owner: str = "") -> None:
        """Track a file another relay wrote into this (shared) directory, as if written here
        (charged whether it fits or not: it is on disk already)."""
        if name not in self._files:
            self._files[name] = self.clock()
            self._sizes[name] = (owner, size)
            self.disk.charge(owner, size)

    def release(self, name: str) -> None:
        """Stop tracking a file without deleting it: the origin relay adopts it back."""
        self._files.pop(name, None)
        entry = self._sizes.pop(name, None)
        if entry is not None:
            self.disk.release(*entry)

    def remove(self, name: str) -> None:
        self.release(name)
        with contextlib.suppress(FileNotFoundError, ValueError):
            self.path(name).unlink()

    def _track(self, name: str, owner: str, size: int) -> None:
        self._files[name] = self.clock()
        self._sizes[name] = (owner, 0)
        self._grow(name, size)

    def _grow(self, name: str, more: int) -> None:
        """Charge `more` bytes of file `name` to its owner, or BodyTooLarge."""
        owner, size = self._sizes[name]
        if size + more > self.max_body:
            self.refused["body"] += 1
            raise BodyTooLarge("body", self.max_body)
        limit = self.disk.check(owner, more)
        if limit is not None:
            kind = "tenant" if limit == "key" else "total"
            self.refused[kind] += 1
            allowed = self.disk.key_bytes if kind == "tenant" else self.disk.total_bytes
            raise BodyTooLarge(kind, allowed)
        self.disk.charge(owner, more)
        self._sizes[name] = (owner, size + more)

    def sweep(self, now: int | None = None, keep: Collection[str] = ()) -> int:
        """Remove tracked files older than `max_age`, except those in `keep` (still wanted);
        returns how many were removed."""
        now = self.clock() if now is None else now
        old = [
            name
            for name, created in self._files.items()
            if name not in keep and (now - created > self.max_age or not self.path(name).exists())
        ]
        for name in old:
            self.remove(name)
        return len(old)

    def sweep_leftovers(self, now_unix: float, max_age: float) -> int:
        """Files of earlier runs (not tracked) whose mtime is over `max_age` seconds old."""
        removed = 0
        for entry in os.scandir(self.directory):
            if not _NAME.fullmatch(entry.name) or entry.name in self._files:
                continue
            with contextlib.suppress(OSError):
                if now_unix - entry.stat().st_mtime > max_age:
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def count(self) -> int:
        return len(self._files)
