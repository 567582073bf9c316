"""A TCP proxy that counts the bytes flowing through it, for tests that account for what a
receiver was sent over the network (weight-sync -> an inference deployment).

`ByteCountingProxy(upstream).start()` listens on 127.0.0.1:<free port> in a background thread and
forwards every connection to `upstream` ("host:port"), counting bytes in each direction:
`to_upstream` is everything the upstream server received through the proxy (request payload,
protobuf and gRPC framing, HTTP/2 control frames), `from_upstream` what it answered. The proxy knows
nothing about gRPC, so its counts are what the receiver's socket saw.
"""

from __future__ import annotations

import asyncio
import threading


class ByteCountingProxy:
    def __init__(self, upstream: str, chunk_bytes: int = 1 << 20) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream_host, self.upstream_port = host or "127.0.0.1", int(port)
        self.chunk_bytes = chunk_bytes
        self.to_upstream = 0
        self.from_upstream = 0
        self.connections = 0
        self.port = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._pumps: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def counts(self) -> tuple[int, int]:
        """(bytes sent to the upstream server, bytes it answered) so far."""
        with self._lock:
            return self.to_upstream, self.from_upstream

    def start(self) -> ByteCountingProxy:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # surfaced to the caller of start()
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name=f"proxy->{self.upstream_port}", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            raise failure[0]
        if not self.port:
            raise RuntimeError("byte-counting proxy did not start within 10s")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._pumps):
                task.cancel()
            await asyncio.gather(*self._pumps, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        self._loop = self._thread = None

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            client_w.close()
            return
        with self._lock:
            self.connections += 1
        pumps = [
            asyncio.ensure_future(self._pump(client_r, up_w, upstream=True)),
            asyncio.ensure_future(self._pump(up_r, client_w, upstream=False)),
        ]
        self._pumps.update(pumps)
        try:
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self._pumps.difference_update(pumps)
            for w in (client_w, up_w):
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool) -> None:
        try:
            while data := await reader.read(self.chunk_bytes):
                with self._lock:
                    if upstream:
                        self.to_upstream += len(data)
                    else:
                        self.from_upstream += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                writer.write_eof()
            except (OSError, RuntimeError):
                pass
