#!/usr/bin/env bash
# Start one hospital's SuperNode in the background, authenticated with the site's private key.
# Its node config (data, ledger, budget, delta, accepted modes, device) is the site's own: the
# server can neither read nor change it. The site's ledger must exist (create it once with
# `gep-fed ledger init`): a missing or tampered ledger stops the start, so a site's privacy
# accounting can never be reset by deleting a file.
#   deploy/start-supernode.sh SITE_ID DATA_FILE LEDGER_FILE EPSILON_BUDGET DELTA [MODES] [DEVICE]
# MODES: "client" (default: only client-side noise) or "client,central" (this site trusts the
# coordinator with unnoised clipped sums). DEVICE: auto (default), cpu or cuda.
# Environment: DEPLOY, PORT (the SuperLink's, default 9300), SUPERLINK_HOST (default 127.0.0.1),
# NODE_PORT (this SuperNode's local runtime API port, default 9400 + the site's number).
set -euo pipefail
: "${DEPLOY:?set DEPLOY}"
usage="usage: start-supernode.sh SITE_ID DATA_FILE LEDGER_FILE EPSILON_BUDGET DELTA [MODES] [DEVICE]"
site=${1:?$usage}
data=${2:?$usage}
ledger=${3:?$usage}
budget=${4:?$usage}
delta=${5:?$usage}
modes=${6:-client}
device=${7:-auto}
gep-fed ledger show "$ledger" > /dev/null || {
  echo "not starting $site: its ledger $ledger is missing or fails verification" >&2
  exit 1
}
number=${site##*-}
node_port=${NODE_PORT:-$((9400 + ${number//[!0-9]/0}))}
mkdir -p "$DEPLOY/pids"
setsid flower-supernode \
  --superlink "${SUPERLINK_HOST:-127.0.0.1}:${PORT:-9300}" \
  --root-certificates "$DEPLOY/secrets/ca.crt" \
  --auth-supernode-private-key "$DEPLOY/secrets/keys/$site" \
  --port "$node_port" \
  --node-config "site-id=\"$site\" data-path=\"$data\" ledger-path=\"$ledger\" epsilon-budget=$budget delta=$delta accept-modes=\"$modes\" device=\"$device\"" \
  > "$DEPLOY/$site.log" 2>&1 &
echo $! > "$DEPLOY/pids/$site.pid"
echo "SuperNode $site started (log: $DEPLOY/$site.log)"
