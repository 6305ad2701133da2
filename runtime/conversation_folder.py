"""The conversation cache's disk tier: a folder of entry and part files
(``runtime.conversation_files``), written by a thread of its own, indexed at start-up and read
back lazily into host slots when an entry is resumed.

Why a class of its own: its writer thread, the queue the engine hands entries to and the
reference counts of the files (a part file goes when no entry file names it) are one job, and
a request never waits for the disk; the cache (``runtime.conversation_cache``) only queues
entries, asks for one back and says which entries it dropped.
"""
from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path

import torch

from .conversation_files import (BLOCK_SUFFIX, BLOCKS, SUFFIX, part_layout, read_entry, read_part, remove,
                                 write_entry, write_part)
from .conversation_host import Activity, HostTier
from .conversation_index import Entry, Index, Part
from .conversation_quiet import Quiet
from .host_pool import Layout
from .pinned import REGISTERING
from .sequence_state import SequenceState

log = logging.getLogger("sparkpack.cache")


class FolderTier:
    """The files of the entries of one model (``key``) in ``folder`` (which other models' files
    may share). ``close`` waits for the queued files."""

    def __init__(self, index: Index, host: HostTier, key: str, folder: Path, quiet: Quiet):
        self.index = index
        self.host = host
        self.key = key
        self.folder = folder
        self.quiet = quiet  # files are written only once no request has computed for a moment
        self._writes: queue.Queue[Entry | None] = queue.Queue()
        self.activity = Activity()  # the writer's files
        (folder / BLOCKS).mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer: threading.Thread | None = threading.Thread(target=self._write_loop,
                                                                 name="sparkpack-cache-writer", daemon=True)
        self._writer.start()

    def close(self) -> None:
        """Finish the files queued for writing."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None

    def part_path(self, name: str) -> Path:
        return self.folder / BLOCKS / (name + BLOCK_SUFFIX)

    def layouts(self, e: Entry) -> tuple[Layout, Layout]:
        """The two pools' layouts that ``e``'s files say (before the session's cache holds a
        token, the pools' shapes are known only from them)."""
        known = tuple(part_layout(self.part_path(n)) for n in (e.parts[0], e.parts[-1]))
        return known if e.has_own else (known[0], [])

    def queue(self, e: Entry) -> None:
        """Write ``e``'s files (the writer holds its parts until then)."""
        self.host.hold(e.parts)
        for n in e.parts:
            self.index.parts[n].queued += 1
        self._writes.put(e)

    def unname(self, names: list[str]) -> None:
        """One entry file fewer names ``names``: a part no entry file names loses its file."""
        for n in names:
            p = self.index.parts.get(n)
            if p is None:
                continue
            p.disk_refs -= 1
            if p.disk_refs <= 0 and p.on_disk and p.queued <= 0:
                remove(self.part_path(n))
                p.on_disk = False
                self.index.forget(p)

    def load(self, e: Entry) -> SequenceState | None:
        """``e``'s state, its parts read into host slots; once more after the queued files are
        written when there was no room (the slots the writer held are free then)."""
        state = self._load_once(e)
        if state is None and e.name in self.index.entries and not e.in_host and self.wait_for_writes():
            state = self._load_once(e)
        return state

    def _load_once(self, e: Entry) -> SequenceState | None:
        """The entry's state, its parts not in host memory read from their files into slots
        (checked as they are read); None when the entry's files are unusable (one log line; the
        entry is forgotten) or there is no room."""
        if e.in_host:
            return self.host.state(e)
        host, index = self.host, self.index
        pools = host.open(lambda: self.layouts(e))
        if pools is None or e.path is None:
            return None
        with index.lock:
            missing = [index.parts[n] for n in e.parts if index.parts[n].slot is None]
            host.hold(e.parts)
            got: list[tuple[Part, int]] = []
            for p in missing:
                slots = host.take(host.pool_of(p), 1)
                if slots is None:
                    for q, s in got:
                        host.pool_of(q).give([s])
                    host.release(e.parts)
                    return None
                got.append((p, slots[0]))
        device = host.session.model.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # (slots given back may still be read by a copy)
        path = e.path
        try:
            for p, s in got:
                path = self.part_path(p.name)
                read_part(path, self.key, p.name, host.pool_of(p), s)
        except (OSError, ValueError) as err:
            log.warning("ignoring conversation cache file %s: %s (recomputing)", path,
                        err.strerror if isinstance(err, OSError) and err.strerror else err)
            index.stats.ignored_files += 1
            with index.lock:
                for q, s in got:
                    host.pool_of(q).give([s])
                host.release(e.parts)
                index.entries.pop(e.name, None)
            return None
        with index.lock:
            for p, s in got:
                p.slot, p.event = s, None
            e.in_host = True
            index.touch(e)
        host.wake()
        return host.state(e)

    def _write_loop(self) -> None:
        while (e := self._writes.get()) is not None:
            try:
                self._write(e)
            except Exception:  # the thread must go on: a request waiting for the queue would wait forever
                log.exception("the conversation cache's writer failed")
            finally:
                self._writes.task_done()
        self._writes.task_done()

    def wait_for_writes(self) -> bool:
        """Wait until the queued files are written (their holds on slots released); False when none
        were queued (or the writer is gone). Called without the lock (the writer takes it)."""
        if self._writer is None or not self._writer.is_alive() or self._writes.unfinished_tasks == 0:
            return False
        was_quiet = self.quiet.is_set()
        self.quiet.set(at_once=True)  # (the engine waits for them: they may go on during a request)
        try:
            self._writes.join()
        finally:  # as it was: a request computing, or the calm from now on
            if was_quiet:
                self.quiet.set()
            else:
                self.quiet.clear()
        return True

    def _write(self, e: Entry) -> None:
        host, index = self.host, self.index
        name = e.name
        with index.lock:
            parts = [index.parts[n] for n in e.parts]
            if index.entries.get(name) is not e:  # dropped meanwhile: nothing to write
                for p in parts:
                    p.queued -= 1
                host.release(e.parts)
                return
        path = None  # the entry's file, once written
        try:
            for p in parts:
                if not p.on_disk and p.slot is not None:
                    self.quiet.wait()
                    if index.entries.get(name) is not e:
                        break  # dropped while it waited (its conversation's next turn): no more of its files
                    with self.activity.piece():
                        if p.event is not None:
                            with REGISTERING:  # (a wait on the device from this thread would break a capture)
                                p.event.synchronize()
                        part = self.part_path(p.name)
                        write_part(part, self.key, p.name, host.pool_of(p), p.slot)
                    with index.lock:
                        p.on_disk, p.file_bytes = True, part.stat().st_size
            else:
                path = self.folder / (name + SUFFIX)
                write_entry(path, self.key, e)
        except Exception as err:  # a full or failing disk, the device failing the copy waited for, a bug
            if isinstance(err, OSError):
                log.warning("cannot write conversation cache file: %s", err)
            else:
                log.exception("writing a conversation state failed")
            with index.lock:
                for p in parts:
                    p.queued -= 1
                host.release(e.parts)
            return
        with index.lock:
            for p in parts:
                p.disk_refs += 1
                p.queued -= 1
            if index.entries.get(name) is e and path is not None:
                e.path = path
            else:  # dropped meanwhile (a longer turn of its conversation replaced it)
                if path is not None:
                    remove(path)
                self.unname(e.parts)
            host.release(e.parts)  # the writer's hold
            if host.ram_bytes == 0 and e.in_host:
                host.leave(e)

    def _scan(self) -> None:
        """Index the folder's entry files of this model (their headers only; the parts are
        checked when used)."""
        index = self.index
        for path in sorted(self.folder.glob("*" + SUFFIX)):
            try:
                meta = read_entry(path)
            except (OSError, ValueError) as err:
                log.warning("ignoring conversation cache file %s: %s", path, err)
                index.stats.ignored_files += 1
                continue
            if meta["key"] != self.key:
                continue  # another model's or other session options' (the folder may be shared)
            name = path.name[: -len(SUFFIX)]
            index.entries[name] = Entry(name, tuple(meta["tokens"]), tuple(meta["cuts"]), meta["parts"],
                                        bool(meta["own"]), path=path, shared=bool(meta["shared"]))
            for n in meta["parts"]:
                p = index.parts.get(n)
                if p is None:
                    try:
                        size = self.part_path(n).stat().st_size
                    except OSError:
                        size = 0  # (found missing when the entry is resumed)
                    p = index.parts[n] = Part(n, own=n.endswith("-own"), on_disk=True, file_bytes=size)
                p.disk_refs += 1
