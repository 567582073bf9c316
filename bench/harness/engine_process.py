"""A weight-only inference engine (WeightOnlyEngine of the tiny model, one rank) as its own process,
for tests where the receiver must live somewhere else than weight-sync: another shared-memory
directory, another namespace host.

`python -m bench.harness.engine_process --host ADDR [--address-file PATH] [--config-json JSON]`
(a ModelConfig as a dict; the tiny model by default) serves until SIGTERM
and writes "ADDRESS host:port" to stdout (and to the file) once it listens; on SIGTERM it prints
"WEIGHTS version bytes_received shm_bytes_received" so a test can read what arrived and how.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from pathlib import Path


async def _serve(host: str, address_file: str, config_json: str) -> None:
    from services.kit.process.hosts import host_identity
    from services.modeling.config import ModelConfig
    from services.modeling.layouts import Layout, rank_params
    from services.weights import WeightOnlyEngine, WeightStager, serve_engine

    config = ModelConfig.from_dict(json.loads(config_json)) if config_json else ModelConfig.tiny()
    engine = WeightOnlyEngine(WeightStager(rank_params(config, Layout(1, "hf"), 0), rank=0))
    server, address = await serve_engine(engine, host=host)
    if address_file:
        Path(address_file).write_text(f"{address} {host_identity()}\n")
    print(f"ADDRESS {address} {host_identity()}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    receiver = engine.receiver
    print(f"WEIGHTS {engine.version} {receiver.bytes_received} {receiver.shm_bytes_received}", flush=True)
    await server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    parser.add_argument("--address-file", default="", help="also write 'host:port host_id' here")
    parser.add_argument("--config-json", default="", help="the model's ModelConfig as JSON (default: tiny)")
    args = parser.parse_args()
    asyncio.run(_serve(args.host, args.address_file, args.config_json))


if __name__ == "__main__":
    main()
