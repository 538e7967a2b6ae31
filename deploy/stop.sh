#!/usr/bin/env bash
# Stop every process the deploy scripts started (each runs in its own process group, which
# also holds the SuperExec and app processes it spawned).
set -uo pipefail
: "${DEPLOY:?set DEPLOY}"
for pidfile in "$DEPLOY"/pids/*.pid; do
  [ -e "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  kill -TERM -- "-$pid" 2>/dev/null
  for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$pid" 2>/dev/null
  rm -f "$pidfile"
done
echo "stopped"
