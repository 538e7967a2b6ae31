#!/usr/bin/env bash
# Start the coordinating site's SuperLink in the background: TLS on, only registered SuperNodes
# may connect, no run-time dependency installation (the environment is prepared beforehand).
# Environment: DEPLOY (working folder with secrets/ from make-certs.sh), PORT (default 9300).
set -euo pipefail
: "${DEPLOY:?set DEPLOY to the working folder of the federation}"
port=${PORT:-9300}
mkdir -p "$DEPLOY/pids"
setsid flower-superlink \
  --ssl-ca-certfile "$DEPLOY/secrets/ca.crt" \
  --ssl-certfile "$DEPLOY/secrets/server.crt" \
  --ssl-keyfile "$DEPLOY/secrets/server.key" \
  --enable-supernode-auth \
  --disable-runtime-dependency-installation \
  --database "$DEPLOY/superlink-state.db" \
  --port "$port" \
  > "$DEPLOY/superlink.log" 2>&1 &
echo $! > "$DEPLOY/pids/superlink.pid"
for _ in $(seq 1 60); do
  grep -q "Uvicorn running on https" "$DEPLOY/superlink.log" 2>/dev/null && break
  sleep 1
done
grep -q "Uvicorn running on https" "$DEPLOY/superlink.log" \
  || { echo "SuperLink did not start; see $DEPLOY/superlink.log" >&2; exit 1; }
echo "SuperLink listening on https://127.0.0.1:$port (log: $DEPLOY/superlink.log)"
