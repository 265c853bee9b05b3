#!/usr/bin/env bash
# Runs a command with outbound network blocked: a fresh network namespace in which only loopback is up
# (torchrun's rendezvous and DVC need 127.0.0.1; nothing else is reachable). Used by `make test`.
# Where namespaces cannot be created (no privileges), it says so and runs the command as it is.
if unshare -n true 2>/dev/null; then
  exec unshare -n bash -c 'ip link set lo up 2>/dev/null || true; export EAGLENEST_NETWORK_BLOCKED=1; exec "$@"' _ "$@"
fi
echo "offline.sh: cannot create a network namespace here; running with the network as it is" >&2
exec "$@"
