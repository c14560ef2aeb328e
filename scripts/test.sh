#!/usr/bin/env bash
# The project's test command on a fresh machine: installs the PostgreSQL server the store
# tests run against (Debian's postgresql package) when it is missing, then the project into
# .venv, then runs pytest with this script's arguments.
set -euo pipefail
cd "$(dirname "$0")/.."

have_postgres() {
    compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || command -v initdb >/dev/null
}

if ! have_postgres; then
    echo "scripts/test.sh: PostgreSQL server binaries not found; installing Debian's postgresql" >&2
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    fi
    $sudo apt-get update
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql
fi

python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest "$@"
