"""A deliberately faulty peer for tests/test_peers.py: an aiohttp server (a thread of the test's
process) that answers the peer protocol's shard requests from a local directory of shard files,
with one fault chosen by ``mode`` (settable at any time):

- ``"ok"``: the right bytes; ``"corrupt"``: the right length, one byte flipped;
- ``"500"``, ``"404"``: that status, no body; ``"stall"``: headers, then half the bytes, then
  nothing (until the test stops it); ``"cut"``: headers, half the bytes, then the connection closed;
- ``"slow"``: the bytes, 8 KB every 0.2 s (a slow holder, for hedging).

It checks no signature (it is the asker's behaviour under test) and counts ``requests``. Its held
summary lists every shard of the directory. Thread-safe: ``mode`` and ``requests`` are plain
attributes read and written by one loop thread and the test."""
from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
from aiohttp import web

from datacache.peer.placement import name_hashes
from tools.s3server import free_ports

__all__ = ["FaultyPeer"]


class FaultyPeer:
    """See the module docstring. ``root``: the directory holding the shard files by name."""

    def __init__(self, root: str, mode: str = "ok") -> None:
        self.root, self.mode, self.requests = root, mode, 0
        self.port = free_ports(1)[0]
        self.addr = f"127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._release = asyncio.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="faulty-peer", daemon=True)
        self._thread.start()
        self._ready.wait(30)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/shard/{dataset}/{digest}/{name:.+}", self._shard)
        app.router.add_get("/v1/held/{dataset}", self._held)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _held(self, request: web.Request) -> web.Response:
        names = sorted(os.listdir(self.root))
        return web.Response(body=np.sort(name_hashes(names)).astype("<u8").tobytes())

    async def _shard(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        mode = self.mode
        if mode in ("500", "404"):
            return web.Response(status=int(mode))
        with open(os.path.join(self.root, request.match_info["name"]), "rb") as f:
            data = bytearray(f.read())
        if mode == "corrupt":
            data[len(data) // 2] ^= 0xFF
        resp = web.StreamResponse(headers={"Content-Length": str(len(data))})
        await resp.prepare(request)
        if mode in ("stall", "cut"):
            await resp.write(bytes(data[: len(data) // 2]))
            if mode == "cut":
                assert request.transport is not None
                request.transport.close()
                return resp
            await self._release.wait()
            return resp
        step = 8192 if mode == "slow" else len(data)
        for i in range(0, len(data), step):
            await resp.write(bytes(data[i:i + step]))
            if mode == "slow":
                await asyncio.sleep(0.2)
        await resp.write_eof()
        return resp

    def close(self) -> None:
        """Stop serving (a stalled answer is let go first). Idempotent."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._release.set)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
