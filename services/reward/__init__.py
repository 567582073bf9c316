"""reward service: rule verifiers, reward models on Ray replicas, weighted composition."""
