"""environment-sandbox service: environments, the agent loop, sandboxed execution, rate limits."""
