"""The local stack's infrastructure processes: an embedded nats-server and a Ray head."""
