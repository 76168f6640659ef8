#!/usr/bin/env bash
# Build (or reuse) the local control plane binaries pinned in versions.env:
#   etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm
#
# Usage: deploy/local/build.sh [--print-dir] [--force]
#   --print-dir  only print the cache directory these versions install into, build nothing
#   --force      rebuild even when the cache is complete
#   --prune      delete cached binaries of other versions/flags (each set is ~500 MB)
# Env:   MOE_CACHE_DIR (default ~/.cache/moe-operator), GOCACHE/GOMODCACHE as usual.
#
# Progress goes to stderr as `[k8s-build] ...` lines; the LAST line on stdout is
# `BIN_DIR=<dir>`, which the Python launcher (moe_operator.devcluster) parses.
#
# All binaries come from ONE module and ONE `go build`, so the thousands of packages they share
# (client-go, apiserver, grpc, ...) are compiled once. A cold build (empty Go build cache) took
# 8m45s on 2 cores; a relink after a flag change ~50s; a warm run (cache complete) only checks
# files and returns in well under a second.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mod_dir="$here/bin-module"
# shellcheck source=versions.env
source "$here/versions.env"

BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm)
PACKAGES=(
  ./cmd/etcd
  k8s.io/kubernetes/cmd/kube-apiserver
  k8s.io/kubernetes/cmd/kube-controller-manager
  k8s.io/kubernetes/cmd/kube-scheduler
  k8s.io/kubernetes/cmd/kubectl
  sigs.k8s.io/kwok/cmd/kwok
  helm.sh/helm/v3/cmd/helm
)
# -trimpath/-s -w: smaller binaries (no DWARF, no symbol table) and no local paths baked in.
# -X: the version stamps the upstream release builds set (kubernetes hack/lib/version.sh, helm's
# Makefile). Without them the API server reports v0.0.0-master on /version, kubectl refuses to
# parse it, and helm renders charts against a wrong .Capabilities.KubeVersion. No build date:
# the flags are part of the cache key, which must not change from one run to the next.
k8s_minor="$(cut -d. -f2 <<<"$KUBERNETES_VERSION")"
LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LDFLAGS+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
  LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit="
done
LDFLAGS+=" -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.metadata="
LDFLAGS+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  LDFLAGS+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done
# CGO off: static binaries, no C toolchain needed, like the upstream release builds.
BUILD_FLAGS=(-trimpath "-ldflags=$LDFLAGS")
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:-} -mod=mod"

log() { printf '[k8s-build] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

print_dir=0 force=0 prune=0
for a in "$@"; do
  case "$a" in
    --print-dir) print_dir=1 ;;
    --force) force=1 ;;
    --prune) prune=1 ;;
    -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown argument: $a" ;;
  esac
done

command -v go >/dev/null || die "go is not on PATH (Go >= 1.26 is needed to build the control plane)"

# go.mod is generated from versions.env; refuse to build a go.mod that disagrees with it, so the
# versions really live in one place (fix: deploy/local/gen-gomod.sh).
check_pin() { # module version
  grep -Eq "^[[:space:]]*(require[[:space:]]+)?$1 $2( |$)" "$mod_dir/go.mod" \
    || die "bin-module/go.mod does not pin $1 $2 from versions.env; run deploy/local/gen-gomod.sh"
}
check_pin k8s.io/kubernetes "$KUBERNETES_VERSION"
check_pin go.etcd.io/etcd/server/v3 "$ETCD_VERSION"
check_pin sigs.k8s.io/kwok "$KWOK_VERSION"
check_pin helm.sh/helm/v3 "$HELM_VERSION"
grep -q "k8s.io/api => k8s.io/api $KUBE_STAGING_VERSION" "$mod_dir/go.mod" \
  || die "bin-module/go.mod staging replaces are not $KUBE_STAGING_VERSION; run deploy/local/gen-gomod.sh"

# Cache key: human-readable versions plus a hash of everything that changes the output
# (module graph, main wrapper, flags, Go version, platform).
go_version="$(go env GOVERSION)"
platform="$(go env GOOS)-$(go env GOARCH)"
digest="$(cat "$here/versions.env" "$mod_dir/go.mod" "$mod_dir/go.sum" "$mod_dir/cmd/etcd/main.go" \
  <(printf '%s\n' "${BUILD_FLAGS[@]}" "$CGO_ENABLED" "$go_version" "$platform" "${PACKAGES[@]}") \
  | sha256sum | cut -c1-12)"
key="k8s-${KUBERNETES_VERSION}-${platform}-${digest}"
cache_root="${MOE_CACHE_DIR:-$HOME/.cache/moe-operator}/k8s-bin"
bin_dir="$cache_root/$key"

if (( print_dir )); then echo "BIN_DIR=$bin_dir"; exit 0; fi

report_others() {
  local d
  for d in "$cache_root"/k8s-*; do
    [[ -d "$d" && "$d" != "$bin_dir" ]] || continue
    if (( prune )); then
      rm -rf "$d" "$cache_root/build-$(basename "$d").log"
      log "pruned $d"
    else
      log "note: $d ($(du -sh "$d" | cut -f1)) is from other versions/flags; --prune deletes it"
    fi
  done
}

complete() {
  [[ -f "$bin_dir/.complete" ]] || return 1
  for b in "${BINARIES[@]}"; do [[ -x "$bin_dir/$b" ]] || return 1; done
}

# kwok ships no built-in stages: without a --config listing Stage objects it refuses to start.
# Install the same defaults `kwokctl` uses (node-fast + heartbeat-with-lease, pod-fast), read
# from the pinned kwok module so they always match the binary.
KWOK_STAGES=(
  kustomize/stage/node/fast/node-initialize.yaml
  kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml
  kustomize/stage/pod/fast/pod-ready.yaml
  kustomize/stage/pod/fast/pod-complete.yaml
  kustomize/stage/pod/fast/pod-delete.yaml
)
install_kwok_stages() { # dest_dir
  [[ -s "$1/kwok-stages.yaml" ]] && return 0
  local kwok_dir
  kwok_dir="$(cd "$mod_dir" && go mod download -json "sigs.k8s.io/kwok@${KWOK_VERSION}" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  [[ -d "$kwok_dir" ]] || die "cannot locate sigs.k8s.io/kwok@${KWOK_VERSION} in the module cache"
  local f
  for f in "${KWOK_STAGES[@]}"; do
    [[ -f "$kwok_dir/$f" ]] || die "kwok stage $f missing in $kwok_dir"
    printf -- '---\n# from sigs.k8s.io/kwok@%s/%s\n' "$KWOK_VERSION" "$f"
    cat "$kwok_dir/$f"
  done >"$1/kwok-stages.yaml.tmp"
  mv "$1/kwok-stages.yaml.tmp" "$1/kwok-stages.yaml"
}

mkdir -p "$cache_root"
# One build per key at a time (a test session and a shell may both ask); the second waits and
# then finds the cache complete.
exec 9>"$cache_root/.lock-$key"
if ! flock -n 9; then
  log "another build of $key is running; waiting for it"
  flock 9
fi

if (( ! force )) && complete; then
  install_kwok_stages "$bin_dir"
  report_others
  log "cache complete: $bin_dir (kubernetes $KUBERNETES_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION, helm $HELM_VERSION)"
  echo "BIN_DIR=$bin_dir"
  exit 0
fi

# Build into a private staging dir and rename at the end: a killed build never leaves a
# half-filled cache dir that a later run would mistake for a complete one.
stage="$(mktemp -d "$cache_root/.build-$key-XXXXXX")"
build_log="$cache_root/build-$key.log"
start=$SECONDS
watcher=""
cleanup() { [[ -n "$watcher" ]] && kill "$watcher" 2>/dev/null || true; rm -rf "$stage"; }
trap cleanup EXIT

log "building ${BINARIES[*]} with $go_version on $(nproc) cores"
log "  kubernetes $KUBERNETES_VERSION (staging $KUBE_STAGING_VERSION), etcd $ETCD_VERSION, kwok $KWOK_VERSION, helm $HELM_VERSION"
log "  log: $build_log   (cold: ~9 min on 2 cores with an empty Go cache; later runs reuse the cache)"

# Progress: `go build -v` logs each package as it is compiled; report every binary as soon as it
# lands in the staging dir, plus a heartbeat with the package count so a long build never looks hung.
(
  seen=""
  last_beat=$SECONDS
  while sleep 5; do
    for b in "${BINARIES[@]}"; do
      if [[ -f "$stage/$b" && " $seen " != *" $b "* ]]; then
        seen="$seen $b"
        log "built $b in $((SECONDS - start))s"
      fi
    done
    if (( SECONDS - last_beat >= 60 )); then
      last_beat=$SECONDS
      n=$(grep -vc '^go: ' "$build_log" 2>/dev/null || true)
      log "still building: $((SECONDS - start))s elapsed, $n packages compiled, last: $(tail -n1 "$build_log" 2>/dev/null)"
    fi
  done
) &
watcher=$!

set +e
(cd "$mod_dir" && go build -v "${BUILD_FLAGS[@]}" -o "$stage/" "${PACKAGES[@]}") >"$build_log" 2>&1
rc=$?
set -e
if (( rc != 0 )); then
  log "go build FAILED (exit $rc) after $((SECONDS - start))s; last lines of $build_log:"
  tail -n 40 "$build_log" | sed 's/^/    /' >&2
  exit "$rc"
fi
for b in "${BINARIES[@]}"; do
  [[ -x "$stage/$b" ]] || die "go build succeeded but $b is missing from $stage (see $build_log)"
done
for b in "${BINARIES[@]}"; do log "built $b ($(du -h "$stage/$b" | cut -f1))"; done
install_kwok_stages "$stage"
{
  echo "built_at=$(date -u +%FT%TZ)"
  echo "build_seconds=$((SECONDS - start))"
  echo "go=$go_version"
  cat "$here/versions.env" | grep -v '^#'
} >"$stage/.complete"
rm -rf "$bin_dir"
chmod 755 "$stage"  # mktemp made it 0700
mv "$stage" "$bin_dir"
log "done in $((SECONDS - start))s: $bin_dir ($(du -sh "$bin_dir" | cut -f1))"
report_others
echo "BIN_DIR=$bin_dir"
