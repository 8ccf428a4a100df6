#!/usr/bin/env bash
# setup.sh converges this machine on what DeltaBox needs to build, run and
# test: Debian packages, CRIU 4.1.1 (built from source, see
# ../shared/design/criu.md) and the Go modules. Run it as root. It is
# idempotent: on a machine that is already set up it only checks, in about a
# second. It is quiet on success (one line per step with its time) and prints
# the failing step's full log on failure.
#
# Environment:
#   DELTABOX_CACHE         where built artifacts are cached (default
#                          /var/cache/deltabox), outside the checkout so CI
#                          and later runs reuse them.
#   DELTABOX_CRIU_INSTALL  where criu is installed (default /usr/local/sbin/criu).
set -euo pipefail

CACHE=${DELTABOX_CACHE:-/var/cache/deltabox}
CRIU_VERSION=4.1.1
CRIU_DEBVERSION=4.1.1-1
CRIU_SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
CRIU_CACHED=$CACHE/criu-$CRIU_VERSION/criu
CRIU_INSTALLED=${DELTABOX_CRIU_INSTALL:-/usr/local/sbin/criu}

# Run-time and test needs, then CRIU's build dependencies (criu.md). No
# protobuf-compiler: generated code is committed.
PACKAGES=(
	btrfs-progs iproute2 xz-utils ca-certificates python3 git perl
	build-essential pkg-config protobuf-c-compiler libprotobuf-c-dev
	libnl-3-dev libnet1-dev libcap-dev uuid-dev
)

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export DEBIAN_FRONTEND=noninteractive
command -v go >/dev/null 2>&1 || export PATH=$PATH:/usr/local/go/bin

if [[ $(id -u) != 0 ]]; then
	echo "setup: must run as root (try: sudo $0)" >&2
	exit 1
fi

LOG=$(mktemp /tmp/deltabox-setup.XXXXXX.log)
T0=$(date +%s%N)
CURRENT=""

ms_since() { echo $((($(date +%s%N) - $1) / 1000000)); }

BUILD_DIR=""

on_exit() {
	local rc=$?
	[[ -n $BUILD_DIR ]] && rm -rf "$BUILD_DIR"
	if [[ $rc != 0 ]]; then
		{
			echo "setup: FAILED in step '${CURRENT:-?}' (exit $rc) after $(ms_since "$T0") ms; its log:"
			sed 's/^/  | /' "$LOG"
		} >&2
	else
		rm -f "$LOG"
	fi
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# step NAME FUNC: runs FUNC with its output in $LOG, then prints NAME, the
# result FUNC left in $RESULT and the time taken.
step() {
	CURRENT=$1
	RESULT=ok
	local t
	t=$(date +%s%N)
	: >"$LOG"
	"$2" >>"$LOG" 2>&1
	printf 'setup: %-12s %-28s %6d ms\n' "$1" "$RESULT" "$(ms_since "$t")"
}

# One setup at a time: a second run waits for the first.
mkdir -p "$CACHE"
exec 9>"$CACHE/setup.lock"
flock 9

# --- Debian packages --------------------------------------------------------

packages() {
	local missing=() p installed
	installed=$(dpkg-query -W -f='${Package} ${Status}\n' "${PACKAGES[@]}" 2>/dev/null | awk '/install ok installed$/ {print $1}' || true)
	for p in "${PACKAGES[@]}"; do
		grep -qx "$p" <<<"$installed" || missing+=("$p")
	done
	if ((${#missing[@]} == 0)); then
		RESULT="ok (${#PACKAGES[@]} present)"
		return
	fi
	echo "missing: ${missing[*]}"
	apt-get update
	apt-get install -y --no-upgrade "${missing[@]}"
	RESULT="installed ${#missing[@]}"
}

# --- CRIU -------------------------------------------------------------------

# criu_works BIN: BIN reports version >= 4 and `criu check` says it looks good.
criu_works() {
	local bin=$1 v
	[[ -x $bin ]] || return 1
	v=$("$bin" --version 2>/dev/null | sed -n 's/^Version: *\([0-9]*\).*/\1/p')
	[[ -n $v && $v -ge 4 ]] || return 1
	"$bin" check 2>&1 | grep -q 'Looks good'
}

# criu_fetch: the verified orig tarball, downloaded once into the cache with
# a private apt configuration (a trixie deb-src list, its own lists and cache
# dirs) so the system's sources and package lists are never touched.
criu_fetch() {
	local src=$CACHE/src tarball=$CACHE/src/criu_$CRIU_VERSION.orig.tar.xz
	if [[ -f $tarball ]] && echo "$CRIU_SHA256  $tarball" | sha256sum -c --status; then
		echo "$tarball"
		return
	fi
	local apt=$CACHE/apt
	mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$src"
	cat >"$apt/sources.list" <<-LIST
		deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main
	LIST
	local opts=(
		-o "Dir::Etc::SourceList=$apt/sources.list"
		-o Dir::Etc::SourceParts=/dev/null
		-o "Dir::State::Lists=$apt/lists"
		-o "Dir::Cache=$apt/cache"
		-o APT::Sandbox::User=root
	)
	apt-get "${opts[@]}" update >&2
	# Only the orig tarball is served, so apt may complain about the rest:
	# the sha256 below is what we trust.
	(cd "$src" && apt-get "${opts[@]}" source --download-only "criu=$CRIU_DEBVERSION") >&2 || true
	if [[ ! -f $tarball ]]; then
		echo "criu: apt did not fetch $(basename "$tarball")" >&2
		return 1
	fi
	if ! echo "$CRIU_SHA256  $tarball" | sha256sum -c --status; then
		echo "criu: sha256 mismatch for $tarball: $(sha256sum "$tarball")" >&2
		rm -f "$tarball"
		return 1
	fi
	echo "$tarball"
}

criu_build() {
	local tarball
	tarball=$(criu_fetch)
	BUILD_DIR=$(mktemp -d /tmp/deltabox-criu-build.XXXXXX)
	tar -C "$BUILD_DIR" -xJf "$tarball"
	make -C "$BUILD_DIR/criu-$CRIU_VERSION" -j"$(nproc)" criu
	mkdir -p "$(dirname "$CRIU_CACHED")"
	install -m 0755 "$BUILD_DIR/criu-$CRIU_VERSION/criu/criu" "$CRIU_CACHED.tmp"
	mv -f "$CRIU_CACHED.tmp" "$CRIU_CACHED"
	rm -rf "$BUILD_DIR"
	BUILD_DIR=""
}

criu() {
	if criu_works "$CRIU_INSTALLED"; then
		RESULT="ok ($("$CRIU_INSTALLED" --version | sed -n 's/^Version: *//p'))"
		return
	fi
	RESULT="installed from cache"
	if ! criu_works "$CRIU_CACHED"; then
		criu_build
		criu_works "$CRIU_CACHED" || {
			echo "criu: the freshly built $CRIU_CACHED fails 'criu check':"
			"$CRIU_CACHED" check || true
			return 1
		}
		RESULT="built $CRIU_VERSION"
	fi
	install -m 0755 "$CRIU_CACHED" "$CRIU_INSTALLED.tmp"
	mv -f "$CRIU_INSTALLED.tmp" "$CRIU_INSTALLED"
	criu_works "$CRIU_INSTALLED"
}

# --- Go modules -------------------------------------------------------------

gomod() {
	(cd "$REPO" && go mod download)
	RESULT="ok ($(go env GOVERSION))"
}

step packages packages
step criu criu
step go-modules gomod
CURRENT=""
echo "setup: done in $(ms_since "$T0") ms"
