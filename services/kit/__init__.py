"""The service kit: what every looprl service needs, written once, one subpackage per concern.

- bus: The event bus: a NATS JetStream connection and publishing (client), pull consumers and their
  deliveries (consumer), stream and bucket provisioning (streams), KV buckets (kv), the names on the
  bus (subjects), per-service NATS users (nats_auth) and the bus's errors.
- messages: What services exchange, written once for both sides: rollouts on the ROLLOUTS stream, a
  run's errors, the trainer's epochs, the packer's reports, micro-batch tensor names and the tensor
  codecs.
- rpc: gRPC: the server bootstrap, interceptors, status errors, the authorization table, mutual TLS
  identities and raw-bytes request handlers.
- config: Configuration: the schema's building blocks, run recipes, service configs from the
  environment, the cluster limits and the table of services.
- telemetry: Telemetry: tracing (OpenTelemetry), structured logs and the table of every metric.
- ray: Ray: joining the configured cluster, surviving the loss of its head, `ray start` for the
  local stack, and autoscaled actor pools.
- local: The local stack's infrastructure processes: an embedded nats-server and a Ray head.
- process: A process and its host: which ports processes listen on, host identity for shared memory,
  and a ready process's startup objects kept out of the garbage collector's way.
- usercode: User code: plugins named by a recipe, and code tests whose verdict the tested code
  cannot forge.

entrypoint (the thin `python -m <service>` entry point) composes them. Which concern may import
which: KIT_LAYERS in tests/unit/test_architecture.py.
"""
