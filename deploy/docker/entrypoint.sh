#!/bin/sh
# Container entrypoint of every looprl service image: `looprl-entrypoint <module> [args...]`.
#
# When LOOPRL_RAY_ADDRESS names a Ray cluster (host:port of the head's GCS), the container first
# joins that cluster as a Ray node with no CPUs or GPUs of its own, so the service is an ordinary
# Ray driver: it places its actors on the cluster's real nodes and keeps the full Ray API
# (streaming generators, which the inference-router uses, are not available through Ray client).
# Then it runs `python -m <module>`, forwards SIGTERM/SIGINT to it (the kit drains: NOT_SERVING,
# in-flight work, NATS), waits for it, and leaves the cluster with `ray stop`; when the service
# exits because the Ray head was lost, it rejoins the new head and starts the service again.
# Without a cluster address (empty, or a ray:// client address) it just execs the service.
set -eu

module="$1"
shift

case "${LOOPRL_RAY_ADDRESS:-}" in
  "" | *://*)
    exec python -m "$module" "$@"
    ;;
esac

# Fixed node ports (6380-6385) and worker ports (10002-10999, this driver's own included): the
# NetworkPolicies (deploy/k8s/base/networkpolicy.yaml) open exactly these between Ray nodes.
join_ray() {
  until ray start --address="$LOOPRL_RAY_ADDRESS" --num-cpus=0 --num-gpus=0 \
    --object-store-memory="${LOOPRL_RAY_OBJECT_STORE_BYTES:-268435456}" --disable-usage-stats \
    --node-manager-port=6380 --object-manager-port=6381 --dashboard-agent-grpc-port=6382 \
    --dashboard-agent-listen-port=6383 --metrics-export-port=6384 --runtime-env-agent-port=6385 \
    --min-worker-port=10002 --max-worker-port=10999 >&2; do
    ray stop --force >/dev/null 2>&1 || true
    sleep 2
  done
}

# A service whose Ray head is lost exits 75 (services/kit/ray/head_loss.py): this node then leaves the
# old cluster, joins the new head once it is up, and starts the service again, which resumes
# from its state (checkpoints, KV) as after any restart.
export LOOPRL_ON_RAY_HEAD_LOSS=exit
child=""
trap 'if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null || true; fi' TERM INT
while :; do
  join_ray
  python -m "$module" "$@" &
  child=$!
  status=0
  wait "$child" || status=$?
  # A trapped signal interrupts `wait` (status > 128) while the service is still draining.
  while kill -0 "$child" 2>/dev/null; do
    status=0
    wait "$child" || status=$?
  done
  ray stop --force >/dev/null 2>&1 || true
  [ "$status" -eq 75 ] || break
  echo "looprl-entrypoint: the Ray head was lost; rejoining and restarting $module" >&2
done
exit "$status"
