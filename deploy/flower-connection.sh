#!/usr/bin/env bash
# Write the Flower CLI's connection to the SuperLink (name "hospitals") into $FLWR_HOME.
set -euo pipefail
: "${DEPLOY:?set DEPLOY}" "${FLWR_HOME:?set FLWR_HOME (config folder of the Flower CLI)}"
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "hospitals"

[superlink.hospitals]
address = "${SUPERLINK_HOST:-127.0.0.1}:${PORT:-9300}"
root-certificates = "$DEPLOY/secrets/ca.crt"
TOML
echo "wrote $FLWR_HOME/config.toml"
