"""Trainer service: FSDP2 ranks on Ray, packed GRPO/PPO loss, sharded checkpoints, weight push."""
