"""A discrete-event simulator of inference deployments: the first piece of a cluster simulator.

- workload.py: request length distributions that drift over a run (output lengths grow as a
  reasoning policy trains, agentic contexts lengthen);
- workers.py: the workers (co-located, as the CPU engine's continuous batching runs them, or
  prefill and decode workers with a KV hand-off) and the event clock;
- deployment.py: one deployment of them, step costs from a `services.decisions.cost_model` (a named
  GPU's roofline or a measured cost-model file), run in synchronous RL steps with the P:D ratio
  tuner (`services.decisions.pd_ratio`, imported, never copied) deciding at every weight-version
  boundary;
- engine_costs.py: the project's engine measured into a cost-model file.

Benches (bench/pd_disaggregation.py, bench/sim_fidelity.py) and tests drive it; no service imports it.
"""
