#!/usr/bin/env bash
# Start one hospital's SuperNode in the background, authenticated with the site's private key.
# Its node config (data, ledger, budget, device) is the site's own: the server never sets it.
#   deploy/start-supernode.sh SITE_ID DATA_FILE LEDGER_FILE [EPSILON_BUDGET] [DEVICE]
# Environment: DEPLOY, PORT (the SuperLink's, default 9300), SUPERLINK_HOST (default 127.0.0.1),
# NODE_PORT (this SuperNode's local runtime API port, default 9400 + the site's number).
set -euo pipefail
: "${DEPLOY:?set DEPLOY}"
site=${1:?usage: start-supernode.sh SITE_ID DATA_FILE LEDGER_FILE [EPSILON_BUDGET] [DEVICE]}
data=${2:?data file}
ledger=${3:?ledger file}
budget=${4:-8.0}
device=${5:-auto}
number=${site##*-}
node_port=${NODE_PORT:-$((9400 + ${number//[!0-9]/0}))}
mkdir -p "$DEPLOY/pids" "$(dirname "$ledger")"
setsid flower-supernode \
  --superlink "${SUPERLINK_HOST:-127.0.0.1}:${PORT:-9300}" \
  --root-certificates "$DEPLOY/secrets/ca.crt" \
  --auth-supernode-private-key "$DEPLOY/secrets/keys/$site" \
  --port "$node_port" \
  --node-config "site-id=\"$site\" data-path=\"$data\" ledger-path=\"$ledger\" epsilon-budget=$budget device=\"$device\"" \
  > "$DEPLOY/$site.log" 2>&1 &
echo $! > "$DEPLOY/pids/$site.pid"
echo "SuperNode $site started (log: $DEPLOY/$site.log)"
