#!/usr/bin/env bash
# The test command of the README, as it must run on a fresh machine: check
# (and, as root on Debian or Ubuntu, install) what the suite needs, then run
# every test. `.ci/run` calls this script; arguments go to `go test`
# (default: -timeout 30m ./...).
#
#   Go                 go.mod's version, on PATH or in /usr/local/go/bin
#   PostgreSQL server  initdb and postgres of any recent major version (tests
#                      start a throwaway cluster; nothing has to run), unless
#                      RECONCILER_TEST_DATABASE_URL names a server to use
#   python3, node, tsc the gateway's example agents (examples/)
#   chromium           the review UI's browser tests (or RECONCILER_CHROMIUM
#                      naming a Chrome or Chromium binary)
#   pg_auto_failover   the failover test (integration/failover_test.go): the
#                      PostgreSQL 15 extension and pg_autoctl
set -euo pipefail
cd "$(dirname "$0")"
export PATH="$PATH:/usr/local/go/bin"

missing=()   # Debian packages to install
need() {     # need COMMAND PACKAGE: PACKAGE provides COMMAND
  command -v "$1" >/dev/null 2>&1 || missing+=("$2")
}

if ! command -v go >/dev/null 2>&1; then
  echo "test.sh: Go is not installed: see https://go.dev/doc/install (go.mod wants $(sed -n 's/^go //p' go.mod))" >&2
  exit 1
fi
if [ -z "${RECONCILER_TEST_DATABASE_URL:-}" ] &&
   ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
  missing+=(postgresql)
fi
need python3 python3
need node nodejs
need tsc node-typescript
if [ -z "${RECONCILER_CHROMIUM:-}" ] && ! command -v chromium >/dev/null 2>&1; then
  missing+=(chromium)
fi

if ! command -v pg_autoctl >/dev/null 2>&1; then
  missing+=(postgresql-15-auto-failover pg-auto-failover-cli)
fi

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "test.sh: missing: ${missing[*]}" >&2
    echo "  install them first, e.g.: sudo apt-get install -y ${missing[*]}" >&2
    echo "  (or run this script as root on Debian or Ubuntu, and it installs them)" >&2
    exit 1
  fi
fi

if [ $# -eq 0 ]; then
  set -- -timeout 30m ./...
fi
exec go test "$@"
