"""The event bus: a NATS JetStream connection and publishing (client), pull consumers and their
deliveries (consumer), stream and bucket provisioning (streams), KV buckets (kv), the names on
the bus (subjects), per-service NATS users (nats_auth) and the bus's errors.
"""
