"""Chain hashes of full KV blocks, the keys of the prefix cache."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forerun.request import Request

# The parent of the first block. Fixed, so that hashes agree across processes and runs.
NONE_HASH = hashlib.sha256(b"forerun/none-hash").digest()


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """Hash one full block; the parent hash makes it identify the whole prefix."""
    h = hashlib.sha256(parent_hash if parent_hash is not None else NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\x00extra")
        h.update(extra)
    return h.digest()


def make_block_hasher(block_size: int) -> Callable[[Request], list[bytes]]:
    """Return a function that hashes every block of a request completed since the last call.

    Only *known* token ids are ever hashed (``request.all_token_ids`` never holds
    placeholders), so a block is hashable only once every id in it is final.
    """

    def hasher(request: Request) -> list[bytes]:
        tokens = request.all_token_ids
        start = len(request.block_hashes)
        parent = request.block_hashes[-1] if start else None
        new: list[bytes] = []
        i = start
        while (i + 1) * block_size <= len(tokens):
            extra = request.cache_salt.encode() if (i == 0 and request.cache_salt) else b""
            parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size], extra)
            new.append(parent)
            i += 1
        return new

    return hasher
