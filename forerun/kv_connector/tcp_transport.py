"""KV blocks over TCP: a producer's block server and a consumer's pull.

One connection per request, in the consumer's hands (a pull: the producer never needs to
know where its KV goes). Frames are an 8-byte big-endian length and a payload; control
frames are JSON.

1. consumer -> ``{"request_id", "fingerprint", "first_block", "num_blocks"}``
2. producer -> ``{"ok": true, "num_layers", "block_bytes"}`` (or ``{"ok": false, "error"}``),
   then per layer one frame of K and one of V: the requested blocks, in order, as the
   cache holds them (the consumer's cache has the same layout: same fingerprint);
3. consumer -> ``{"done": true}`` once it has written every block: the producer then frees
   them and answers ``{"ok": true}``. A consumer that vanishes first leaves the offer in
   place until it expires.

Reads of the producer's cache run on the server's threads while steps run: the blocks
offered belong to a finished request whose free is held back until ``done`` (or the
offer's expiry), and they are full blocks before any position a step still in flight may
write, so no step writes them while they are read.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

_LEN = struct.Struct(">Q")
_MAX_CONTROL = 1 << 20


class TransferError(RuntimeError):
    """A pull that did not complete (the producer refused, vanished or sent garbage)."""


def send_frame(sock: socket.socket, payload: bytes | memoryview) -> None:
    sock.sendall(_LEN.pack(len(payload)))
    sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise TransferError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_frame(sock: socket.socket, limit: int) -> memoryview:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > limit:
        raise TransferError(f"frame of {n} bytes, more than the {limit} expected")
    return _recv_exact(sock, n)


def send_json(sock: socket.socket, obj: dict[str, Any]) -> None:
    send_frame(sock, json.dumps(obj).encode())


def recv_json(sock: socket.socket) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(recv_frame(sock, _MAX_CONTROL)))
    except (ValueError, UnicodeDecodeError) as e:
        raise TransferError(f"bad control frame: {e}") from None
    if not isinstance(obj, dict):
        raise TransferError("bad control frame: not an object")
    return obj


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


@dataclass(slots=True)
class Offer:
    """A finished request's blocks, readable until ``expires`` (monotonic seconds)."""

    block_ids: list[int]
    expires: float


class KVBlockServer:
    """Serves offered requests' KV blocks from this engine's cache (threads of its own).

    ``offer`` and ``take_done`` are called by the engine (any thread); connections are
    served on the server's threads.
    """

    def __init__(self, host: str, port: int, fingerprint: str, offer_timeout_s: float) -> None:
        self.fingerprint = fingerprint
        self.offer_timeout_s = offer_timeout_s
        self._kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lock = threading.Lock()
        self._offers: dict[str, Offer] = {}
        self._done: set[str] = set()
        self._ready = threading.Event()
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="forerun-kv-server", daemon=True)
        self._thread.start()
        logger.info("KV block server on %s:%d", self.host, self.port)

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._kv_caches = list(kv_caches)
        self._ready.set()

    def offer(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._offers[request_id] = Offer(list(block_ids),
                                             time.monotonic() + self.offer_timeout_s)

    def take_done(self) -> set[str]:
        """Requests whose blocks may be freed now: read by their consumer, or expired."""
        now = time.monotonic()
        with self._lock:
            for rid, offer in list(self._offers.items()):
                if offer.expires <= now:
                    logger.warning("KV of request %s was not read within %.0f s; freed",
                                   rid, self.offer_timeout_s)
                    del self._offers[rid]
                    self._done.add(rid)
            done, self._done = self._done, set()
        return done

    def has_offers(self) -> bool:
        with self._lock:
            return bool(self._offers)

    def _serve(self, sock: socket.socket) -> None:
        try:
            ask = recv_json(sock)
            rid = ask.get("request_id")
            with self._lock:
                offer = self._offers.get(rid) if isinstance(rid, str) else None
            first, count = ask.get("first_block", 0), ask.get("num_blocks", -1)
            error = None
            if ask.get("fingerprint") != self.fingerprint:
                error = "the KV layout differs (another model, dtype or block size)"
            elif offer is None:
                error = f"no KV is offered for request {rid!r} (expired or never made)"
            elif not (isinstance(first, int) and isinstance(count, int) and first >= 0
                      and 0 < count and first + count <= len(offer.block_ids)):
                error = f"blocks {first}+{count} out of the {len(offer.block_ids)} offered"
            elif not self._ready.wait(timeout=10.0):
                error = "the KV cache is not registered yet"
            if error is not None:
                send_json(sock, {"ok": False, "error": error})
                return
            assert offer is not None
            ids = torch.tensor(offer.block_ids[first:first + count], dtype=torch.long)
            k0 = self._kv_caches[0][0]
            send_json(sock, {"ok": True, "num_layers": len(self._kv_caches),
                             "block_bytes": k0[0].numel() * k0.element_size()})
            for k_cache, v_cache in self._kv_caches:
                send_frame(sock, _as_bytes(k_cache.index_select(0, ids)))
                send_frame(sock, _as_bytes(v_cache.index_select(0, ids)))
            if recv_json(sock).get("done") is True:
                with self._lock:
                    if self._offers.pop(rid, None) is not None:
                        self._done.add(rid)
                send_json(sock, {"ok": True})
        except (OSError, TransferError) as e:
            logger.info("KV block server: a pull ended early: %s", e)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def pull_blocks(host: str, port: int, request_id: str, fingerprint: str, first_block: int,
                local_block_ids: list[int], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                timeout_s: float) -> int:
    """Read ``len(local_block_ids)`` of a producer's offered blocks, from ``first_block``,
    into this engine's blocks ``local_block_ids``; the bytes read. TransferError or OSError
    when the pull fails (nothing is then acknowledged; blocks may be partly written)."""
    n = len(local_block_ids)
    dst = torch.tensor(local_block_ids, dtype=torch.long)
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        send_json(sock, {"request_id": request_id, "fingerprint": fingerprint,
                         "first_block": first_block, "num_blocks": n})
        head = recv_json(sock)
        if not head.get("ok"):
            raise TransferError(str(head.get("error", "refused")))
        k0 = kv_caches[0][0]
        block_bytes = k0[0].numel() * k0.element_size()
        if head.get("num_layers") != len(kv_caches) or head.get("block_bytes") != block_bytes:
            raise TransferError("the producer's KV layout differs from this engine's")
        total = 0
        for k_cache, v_cache in kv_caches:
            for cache in (k_cache, v_cache):
                buf = torch.empty((n, *cache.shape[1:]), dtype=cache.dtype)
                view = _as_bytes(buf)
                (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
                if size != len(view):
                    raise TransferError(f"a layer of {size} bytes, {len(view)} expected")
                _recv_exact(sock, size, view)
                cache.index_copy_(0, dst, buf)
                total += size
        send_json(sock, {"done": True})
        recv_json(sock)  # the producer has let the blocks go
    return total
