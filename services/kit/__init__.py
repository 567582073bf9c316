"""The service kit: what every looprl service needs, written once.

config (typed env config), errors (gRPC status mapping), server (gRPC aio bootstrap with
health, reflection, interceptors, metrics and graceful SIGTERM), telemetry (OpenTelemetry),
logs (structured JSON logs), codec (tensors <-> protobuf), bus (NATS JetStream),
recipe (run recipes), local (embedded nats-server and Ray head), ray_utils.
The kit imports no service.
"""
