#!/usr/bin/env bash
# Start one hospital's SuperNode in the background, authenticated with the site's private key,
# running only the app bundle the site reviewed, for the task the site chose.
#   TASK=NAME PINNED_FAB=SHA256[,SHA256] deploy/start-supernode.sh SITE_ID DATA_FILE \
#     LEDGER_FILE EPSILON_BUDGET DELTA [MODES] [DEVICE]
# Its node config (task, data, ledger, budget, delta, accepted modes, device) is the site's own:
# the server can neither read nor change it.
# TASK (required): the task this site trains, a built-in name or 'package.module:Class'. A run
# whose run config names another task is refused before anything is imported.
# PINNED_FAB (required): the SHA-256 of the app bundle (FAB) this site reviewed; several are
# separated by commas. A SuperNode would run whatever bundle the SuperLink sends, and a bundle's
# ClientApp can read the site's data. So the SuperNode runs in process isolation (it starts no
# app itself) beside the site's verifying launcher, gep_fed.flower.pinned_clientapp, which
# runs a ClientApp task only if its bundle is pinned and otherwise answers it with an error reply
# ("invalid app bundle") before anything of the bundle is unpacked or imported. The launcher is
# in the SuperNode's process group and stops with it. Compute the pin from the reviewed .fab file
# (`flwr build` in the project folder writes one; `flwr run` sends the same bytes) with
#   PINNED_FAB=$(sha256sum app.fab | cut -d' ' -f1)
# (or python -m gep_fed.flower.app_pin app.fab), or, for the bundle `flwr run FOLDER` sends
# from a project folder the site reviewed,
#   PINNED_FAB=$(python -m gep_fed.flower.app_pin FOLDER)
# Before starting, `gep-fed site check` reads every example of the site's data and verifies its
# ledger (create it once with `gep-fed ledger init`): a problem stops the start, since during a
# run a bad example is dropped silently and a missing or older ledger must never be replaced.
# MODES: "client" (default: only client-side noise), or a list adding "central" (this site trusts
# the coordinator with unnoised clipped sums) and/or "distributed" (the coordinator sees only the
# sum of the sites' noised shares, masked with the pinned peers; needs NOISE_SHARES, the site's
# secure-sum key SITE_KEY, default $DEPLOY/secrets/secure-sum/SITE_ID.pem, and its peers file
# PEERS, default $DEPLOY/secrets/secure-sum/peers.txt; the colluding sites it assumes go in
# EXTRA_NODE_CONFIG: 'max-colluding-sites=1'). DEVICE: auto (default), cpu or cuda.
# Environment: DEPLOY, PORT (the SuperLink's, default 9300), SUPERLINK_HOST (default 127.0.0.1),
# NODE_PORT (this SuperNode's local runtime API port, default 9400 + the site's number),
# EXTRA_NODE_CONFIG (more node config keys, appended as given: 'ledger-key-path="/keys/k"').
set -euo pipefail
: "${DEPLOY:?set DEPLOY}"
usage="usage: TASK=NAME PINNED_FAB=SHA256 start-supernode.sh SITE_ID DATA_FILE LEDGER_FILE EPSILON_BUDGET DELTA [MODES] [DEVICE]"
site=${1:?$usage}
data=${2:?$usage}
ledger=${3:?$usage}
budget=${4:?$usage}
delta=${5:?$usage}
modes=${6:-client}
device=${7:-auto}
task=${TASK:?set TASK to the task this site trains (a built-in name or package.module:Class)}
pins=${PINNED_FAB:?set PINNED_FAB to the SHA-256 of the app bundle this site reviewed (see the header of $0)}
[[ $pins =~ ^[0-9a-fA-F]{64}(,[0-9a-fA-F]{64})*$ ]] || {
  echo "not starting $site: PINNED_FAB must be SHA-256 hex digests separated by commas" >&2
  exit 1
}
node_config="site-id=\"$site\" task=\"$task\" data-path=\"$data\" ledger-path=\"$ledger\" epsilon-budget=$budget delta=$delta accept-modes=\"$modes\" device=\"$device\" ${EXTRA_NODE_CONFIG:-}"
if [[ ,$modes, == *,distributed,* ]]; then
  shares=${NOISE_SHARES:?set NOISE_SHARES: the shares this site splits its noise into in distributed mode}
  node_config="$node_config noise-shares=$shares site-key=\"${SITE_KEY:-$DEPLOY/secrets/secure-sum/$site.pem}\" peers=\"${PEERS:-$DEPLOY/secrets/secure-sum/peers.txt}\""
fi
gep-fed site check --node-config "$node_config" > "$DEPLOY/$site.check" 2>&1 || {
  echo "not starting $site: its site check failed ($DEPLOY/$site.check):" >&2
  tail -n 25 "$DEPLOY/$site.check" >&2
  exit 1
}
number=${site##*-}
node_port=${NODE_PORT:-$((9400 + ${number//[!0-9]/0}))}
mkdir -p "$DEPLOY/pids"
# One process group: the launcher (background) and the SuperNode (exec'd, so $$ is its pid).
PINNED_FAB=$pins RUNTIME_API="127.0.0.1:$node_port" setsid bash -c \
  'python -m gep_fed.flower.pinned_clientapp --pinned-fab "$PINNED_FAB" \
     --runtime-api-address "$RUNTIME_API" --insecure --parent-pid $$ &
   exec "$@"' pinned-launcher \
  flower-supernode \
  --superlink "${SUPERLINK_HOST:-127.0.0.1}:${PORT:-9300}" \
  --root-certificates "$DEPLOY/secrets/ca.crt" \
  --auth-supernode-private-key "$DEPLOY/secrets/keys/$site" \
  --isolation process \
  --host 127.0.0.1 \
  --port "$node_port" \
  --node-config "$node_config" \
  > "$DEPLOY/$site.log" 2>&1 &
echo $! > "$DEPLOY/pids/$site.pid"
echo "SuperNode $site started for task $task, running only app bundle(s) $pins (log: $DEPLOY/$site.log)"
