"""Decisions as pure modules: measurements in, a decision with its reason out; no I/O, no clock.

- length_prediction.py: each request's expected output length, from a running estimate per task
  source and request profile, sharpened by earlier samples of the same group and prompt (the agent
  loop asks it; the router routes on the answer);
- pd_ratio.py: the prefill:decode worker ratio of a deployment, from measured stage speeds and the
  observed length distribution, with hysteresis, bounded moves and decisions only at weight-version
  boundaries;
- cost_model.py: per-token prefill and decode costs of a named GPU (roofline defaults) or of a
  measured cost-model file (tools/gpu_torch_check.py writes one), which the tuner and the deployment
  simulator (sim/) read.

Services call these and log or export what they decide; the simulator imports the same modules,
never a copy. This package imports no service and nothing heavy (no torch, no pydantic).
"""
