"""Ray: joining the configured cluster, surviving the loss of its head, `ray start` for the
local stack, and autoscaled actor pools.
"""
