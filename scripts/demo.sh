#!/usr/bin/env bash
# demo.sh is the README's main command: it converges the machine
# (scripts/setup.sh), then runs `deltabox demo`, which starts a private daemon
# on the default storage, runs a tree search over a sandbox with live
# checkpoints, prints the tree and the checkpoint/restore latencies, and
# cleans up. Extra arguments go to `deltabox demo`.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v go >/dev/null 2>&1 || export PATH=$PATH:/usr/local/go/bin
export HOME=${HOME:-/root}

scripts/setup.sh
go build -o bin/ ./cmd/deltabox ./cmd/deltabox-init
exec bin/deltabox demo "$@"
