"""The gateway: looprl's only door from outside.

gRPC GatewayService and HTTP/JSON for runs, an OpenAI-compatible endpoint in front of the
inference-router, bearer-token auth, run control (feeding episodes under the staleness bound,
run state in JetStream KV), and the `looprl` CLI with the local stack.
"""
