#!/usr/bin/env bash
# The project's test command on a fresh machine: installs the Debian packages the tests run
# against when they are missing (the PostgreSQL server of the store tests, the Prometheus
# server and promtool of the dashboard and alert tests, the Chromium of the HTML report
# test), then the project into .venv, then runs pytest with this script's arguments (without
# any: the whole suite, in the two runs below).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
if ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null && ! command -v initdb >/dev/null; then
    missing+=(postgresql)
fi
command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
command -v chromium >/dev/null || missing+=(chromium)

if [ ${#missing[@]} -gt 0 ]; then
    echo "scripts/test.sh: installing Debian's ${missing[*]} (not found)" >&2
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    fi
    $sudo apt-get update
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
    # Debian starts the services it installs; the tests start their own, on their own ports
    for service in prometheus prometheus-node-exporter; do
        if command -v systemctl >/dev/null && systemctl is-active --quiet "$service" 2>/dev/null; then
            $sudo systemctl stop "$service" || true
        fi
    done
fi

python3 -m venv .venv && .venv/bin/pip install -e '.[test]'

if [ $# -gt 0 ]; then   # the caller chose what to run
    exec .venv/bin/python -m pytest "$@"
fi
# The whole suite, in two runs. The component tier (real gRPC servers, PostgreSQL, the
# watchdog's thresholds) mostly waits on the clock, so it runs on 3 pytest-xdist workers:
# about 2.5 minutes instead of 6 on 2 cores. The unit and integration tiers keep the CPU
# busy (gloo process groups, a local Ray cluster per test), so they run one test at a time:
# parallel, they would only slow each other down and crowd the timing checks. Both runs
# always run; either failing (or collecting no tests: exit code 5) fails the whole.
status=0
.venv/bin/python -m pytest -n 3 tests/component || status=$?
.venv/bin/python -m pytest tests/unit tests/integration || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
exit "$status"
