#!/usr/bin/env bash
# test.sh is the project's test command (README.md, .ci/run): go vet, then
# every package's tests, two packages at a time (the machines have 2 cores).
# Privileged tests need root; with DELTABOX_REQUIRE_ALL=1 a test that would
# skip for a missing feature fails instead. Extra arguments go to go test
# (e.g. scripts/test.sh -run TestFreeze ./internal/sandbox/cgroup/); with
# no ./package argument it vets and tests ./... .
#
# The full verbose log is kept in $DELTABOX_TEST_LOG (default: a temp file);
# the terminal gets it without the RUN/PASS chatter, then one closing line:
#   tests: N passed, N failed, N skipped
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v go >/dev/null 2>&1 || export PATH=$PATH:/usr/local/go/bin
export HOME=${HOME:-/root}

# Converge the machine first (about a second when it is set up already), so
# that this one command is all a fresh machine needs.
if [[ ${DELTABOX_SKIP_SETUP:-} != 1 ]]; then
	scripts/setup.sh
fi

LOG=${DELTABOX_TEST_LOG:-$(mktemp /tmp/deltabox-test.XXXXXX.log)}
T0=$(date +%s)
args=("$@")
# Packages: ./... unless arguments name some (./path); go vet takes only them.
pkgs=()
vet=()
for a in "${args[@]}"; do [[ $a == ./* ]] && vet+=("$a"); done
if ((${#vet[@]} == 0)); then
	pkgs=(./...)
	vet=(./...)
fi

status=0
echo "test: go vet ${vet[*]}"
if ! go vet "${vet[@]}"; then
	echo "test: go vet FAILED"
	status=1
fi

echo "test: go test (log: $LOG)"
go test -count=1 -timeout 14m -p 2 -v "${args[@]}" "${pkgs[@]}" 2>&1 |
	tee "$LOG" |
	grep --line-buffered -Ev '^[[:space:]]*(=== (RUN|PAUSE|CONT|NAME)|--- PASS:)'
gotest=${PIPESTATUS[0]}

count() { grep -Ec "^[[:space:]]*--- $1:" "$LOG"; }
passed=$(count PASS)
failed=$(count FAIL)
skipped=$(count SKIP)
if ((gotest != 0)); then
	status=1
	# A build failure or a panic fails a package without a "--- FAIL" line.
	((failed == 0)) && failed=$(grep -Ec '^FAIL[[:space:]]' "$LOG")
	((failed == 0)) && failed=1
fi
echo "test: go test exit $gotest after $(($(date +%s) - T0)) s"
echo "tests: $passed passed, $failed failed, $skipped skipped"
exit $status
