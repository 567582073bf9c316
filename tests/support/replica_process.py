"""One looprl inference replica (ReplicaCore: the CPU engine with its weight lifecycle, no weights
until some are staged) as its own process, serving InferenceEngineService with mutual TLS as the
inference-router's replicas do, for tests that check the engine contract on a replica no run uses.

`python -m tests.support.replica_process --tls-dir DIR [--max-model-len N]` prints
"ADDRESS host:port" once it serves, and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal


async def _serve(tls_dir: str, max_model_len: int) -> None:
    from services.inference_router.replica import ReplicaCore
    from services.kit.config.recipe import DeploymentSpec
    from services.kit.rpc import tls

    creds = tls.Credentials.from_dir("inference-router", tls_dir)
    exported = {"identity": creds.identity, "ca": creds.ca, "cert": creds.cert, "key": creds.key}
    spec = DeploymentSpec(name="conformance", max_model_len=max_model_len, max_batch_size=8)
    core = ReplicaCore(spec=spec, replica="conformance-r0", tls_credentials=exported, num_threads=1)
    address = await core.start()
    print(f"ADDRESS {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    await core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tls-dir", required=True, help="ca.crt and inference-router.crt/.key")
    parser.add_argument("--max-model-len", type=int, default=128)
    args = parser.parse_args()
    asyncio.run(_serve(args.tls_dir, args.max_model_len))


if __name__ == "__main__":
    main()
