"""What benchmarks and tests share to run parts of looprl outside a stack: namespace hosts and
processes on them, a local router fleet, a weight-only engine process, synthetic rollouts and weight
pushes. Benchmarks import only this and the product (tests/ is not installed), so `bench` runs from
an installed wheel too."""
