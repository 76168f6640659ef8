#!/usr/bin/env bash
# Build (or reuse from cache) the local control plane binaries; see deploy/local/build.sh.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../deploy/local/build.sh" "$@"
