"""inference-router service: deployments of engine replicas (Ray actors or external servers) and
the InferenceRouter gRPC service that routes generation across them by length profile, load,
session affinity and weight version. Run it with `python -m services.inference_router`."""
