"""Rollout packer: groups, advantages, staleness filter and DP-balanced packed micro-batches."""
