"""Trainer service: FSDP2 ranks on Ray, packed GRPO-family policy-gradient loss (clipped, no critic),
sharded checkpoints, weight push."""
