#!/bin/bash
# The hidden tests, run in the final workspace; the reward goes to /logs/verifier.
cd /workspace
if python -P -m pytest -q -p no:cacheprovider /tests; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
