"""The disk tier: one file per block, named by its chain hash, under a fingerprint folder.

File layout: a fixed header (magic, version, the model/dtype/layout fingerprint, the block's
chain hash, the payload length, a BLAKE2b-256 checksum of the payload) then the payload. A
file is written under a temporary name and renamed, so a reader sees a whole file or none;
a file whose header or checksum does not match is deleted and reported missing (the engine
recomputes), never used. The folder is named by the fingerprint, so a different model or
dtype never even looks at another's files, and a restart with the same one finds them.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
from collections import OrderedDict
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAGIC = b"FRKV"
VERSION = 1
_HEADER = struct.Struct("<4sI32s32sQ32s")
SUFFIX = ".kv"


def _checksum(payload: memoryview | bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


class DiskTier:
    """Block files under ``root/<fingerprint>/``, at most ``capacity_bytes`` of them (LRU by
    size: the least recently written or read go first). A write that fails (a full disk, a
    read-only folder) is logged and dropped: the block is then simply not offloaded.

    Not thread-safe by itself (the store holds the lock).
    """

    def __init__(self, root: str | os.PathLike[str], fingerprint: bytes,
                 capacity_bytes: int) -> None:
        assert len(fingerprint) == 32
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint.hex()[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.num_write_errors = 0
        self.num_corrupt = 0
        self._files: OrderedDict[bytes, int] = OrderedDict()
        self._scan()

    def _scan(self) -> None:
        """Index the files a previous run left, oldest first (leftover temporaries go)."""
        entries = []
        for p in self.dir.iterdir():
            if p.suffix != SUFFIX:
                if p.name.startswith(".tmp"):
                    p.unlink(missing_ok=True)
                continue
            try:
                h = bytes.fromhex(p.stem)
                st = p.stat()
            except (ValueError, OSError):
                continue
            if len(h) == 32:
                entries.append((st.st_mtime_ns, h, st.st_size))
        for _, h, size in sorted(entries):
            self._files[h] = size
            self.used_bytes += size
        if entries:
            logger.info("KV offload: %d block files (%d MiB) found in %s", len(entries),
                        self.used_bytes >> 20, self.dir)

    def path_of(self, block_hash: bytes) -> Path:
        return self.dir / f"{block_hash.hex()}{SUFFIX}"

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._files

    def __len__(self) -> int:
        return len(self._files)

    def _forget(self, block_hash: bytes, unlink: bool) -> None:
        size = self._files.pop(block_hash, None)
        if size is not None:
            self.used_bytes -= size
        if unlink:
            try:
                self.path_of(block_hash).unlink(missing_ok=True)
            except OSError:
                pass

    def put(self, block_hash: bytes, payload: torch.Tensor) -> bool:
        """Write one block (atomically); False (logged) if it could not be written."""
        if block_hash in self._files:
            self._files.move_to_end(block_hash)
            return True
        data = memoryview(payload.numpy())
        size = _HEADER.size + len(data)
        if size > self.capacity_bytes:
            return False
        while self._files and self.used_bytes + size > self.capacity_bytes:
            oldest = next(iter(self._files))
            self._forget(oldest, unlink=True)
        header = _HEADER.pack(MAGIC, VERSION, self.fingerprint, block_hash, len(data),
                              _checksum(data))
        tmp = self.dir / f".tmp{os.getpid()}-{block_hash.hex()[:16]}"
        try:
            self._write_file(tmp, header, data)
            os.replace(tmp, self.path_of(block_hash))
        except OSError as exc:
            self.num_write_errors += 1
            tmp.unlink(missing_ok=True)
            # A full disk is expected under load: the block stays RAM-only (or recomputed).
            level = logging.WARNING if self.num_write_errors == 1 else logging.DEBUG
            logger.log(level, "KV offload: writing a block to %s failed (%s%s); it is not "
                       "kept on disk", self.dir, errno.errorcode.get(exc.errno or 0, "?"),
                       f": {exc.strerror}" if exc.strerror else "")
            return False
        self._files[block_hash] = size
        self.used_bytes += size
        return True

    @staticmethod
    def _write_file(path: Path, header: bytes, data: memoryview) -> None:
        with open(path, "wb") as f:
            f.write(header)
            f.write(data)

    def get(self, block_hash: bytes, expected_bytes: int) -> torch.Tensor | None:
        """The block's payload, or None if absent, truncated, corrupt or not this model's."""
        if block_hash not in self._files:
            return None
        try:
            with open(self.path_of(block_hash), "rb") as f:
                raw = f.read()
        except OSError as exc:
            logger.warning("KV offload: reading %s failed (%s); recomputing",
                           self.path_of(block_hash), exc)
            self._forget(block_hash, unlink=False)
            return None
        why = self._check(raw, block_hash, expected_bytes)
        if why is not None:
            self.num_corrupt += 1
            logger.warning("KV offload: ignoring %s (%s); the block is recomputed",
                           self.path_of(block_hash), why)
            self._forget(block_hash, unlink=True)
            return None
        self._files.move_to_end(block_hash)
        return torch.frombuffer(bytearray(raw[_HEADER.size:]), dtype=torch.uint8)

    def _check(self, raw: bytes, block_hash: bytes, expected_bytes: int) -> str | None:
        if len(raw) < _HEADER.size:
            return "shorter than its header"
        magic, version, fp, h, length, checksum = _HEADER.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            return "not a forerun KV block file of this version"
        if fp != self.fingerprint:
            return "written for another model or KV layout"
        if h != block_hash:
            return "its header names another block"
        if length != expected_bytes or len(raw) - _HEADER.size != length:
            return f"truncated or mis-sized ({len(raw) - _HEADER.size} of {expected_bytes} bytes)"
        if _checksum(memoryview(raw)[_HEADER.size:]) != checksum:
            return "checksum mismatch"
        return None
