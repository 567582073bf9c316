"""A receiving engine the kit serves itself, so weight-sync's deliveries can be watched: looprl's
reference receiver (services/weights WeightOnlyEngine: stages, verifies and commits every version it
is sent) on a gRPC server in a thread of the kit, with a server certificate weight-sync trusts.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np

from conformance.target import Credentials
from conformance.weights import Model
from services.modeling.layouts import Layout, rank_params
from services.weights import WeightOnlyEngine, WeightStager, add_engine_servicer


class Receiver:
    def __init__(self, model: Model, credentials: Credentials | None, identity: str, host: str) -> None:
        self.model = model
        self.engine = WeightOnlyEngine(WeightStager(rank_params(model.config, Layout(1, "hf"), 0), rank=0))
        self._credentials = credentials
        self._identity = identity
        self._host = host
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="conformance-receiver", daemon=True
        )
        self._server: grpc.aio.Server | None = None
        self.address = ""

    def start(self) -> str:
        self._thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(30)
        return self.address

    async def _serve(self) -> str:
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.so_reuseport", 0)]
        )
        add_engine_servicer(server, self.engine)
        creds = self._credentials
        if creds is None:
            port = server.add_insecure_port(f"{self._host}:0")
        else:
            identity = creds.identities.get(self._identity)
            if identity is None:
                raise ValueError(f"no certificate for the receiver's identity {self._identity!r}")
            server_creds = grpc.ssl_server_credentials(
                [(identity.key, identity.cert)], root_certificates=creds.ca, require_client_auth=True
            )
            port = server.add_secure_port(f"{self._host}:0", server_creds)
        await server.start()
        self._server = server
        return f"{self._host}:{port}"

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def version(self) -> int:
        return self.engine.version

    def wait_version(self, version: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.engine.version >= version:
                return True
            time.sleep(0.05)
        return False

    def mismatched(self, seed: int) -> list[str]:
        """Parameters whose served bytes differ from the version the kit pushed with `seed`."""
        expected = self.model.state(seed)
        served = dict(self.engine.weights)
        wrong = []
        for name, values in expected.items():
            got = served.get(name)
            if got is None or not np.array_equal(got.detach().cpu().numpy().reshape(values.shape), values):
                wrong.append(name)
        return wrong
