"""Telemetry: tracing (OpenTelemetry), structured logs and the table of every metric."""
