#!/usr/bin/env bash
# Idempotent set-up for a fresh machine, into a virtual environment of its own (.venv), so that a
# Debian or Ubuntu Python that refuses pip ("externally managed", PEP 668) works as any other:
#
#   scripts/install.sh demo   the environment: CPU torch, this package (editable) and its dev tools
#   scripts/install.sh test   the same, plus the Debian packages and tools the test suite runs
#                             (Prometheus, Chromium, PostgreSQL, HAProxy, openssl; SGLang's wheels
#                             to read, checkov); `make test` runs this one, `make demo` the first
#
# Every pip step uses constraints.txt so nothing can swap the CPU torch for a CUDA build.
# Re-running it when everything is in place takes a few seconds. BASE_PYTHON (python3) makes the
# environment; VENV (.venv) is where it goes.
set -euo pipefail
cd "$(dirname "$0")/.."

FOR=${1:-test}
case "$FOR" in demo | test) ;; *) echo "usage: scripts/install.sh [demo|test]" >&2; exit 2 ;; esac
BASE=${BASE_PYTHON:-python3}
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
export PIP_ROOT_USER_ACTION=ignore
PIP=("$PY" -m pip install --disable-pip-version-check -q --no-compile -c constraints.txt)

apt_install() {  # the Debian packages of "$@" that are missing
  local missing=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  ((${#missing[@]})) || return 0
  if ! command -v apt-get >/dev/null; then
    echo "install: not a Debian or Ubuntu system (no apt-get); install ${missing[*]} yourself" >&2
    exit 1
  fi
  echo "install: apt packages: ${missing[*]}"
  local SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # A Debian package starts its system service where an init system runs; the tests start their own.
  local service
  for service in prometheus postgresql haproxy; do $SUDO service "$service" stop >/dev/null 2>&1 || true; done
}

# Steps that do not depend on the Python packages (the Debian packages, checkov's environment) run
# beside them: from nothing on the 2-core box that took the set-up from 165 s to 142.5 s (median of
# two runs each, bench/results/install.md). Each one's output is kept and printed when it ends; one
# that fails fails the install, and the script never exits while one still runs (an apt-get cut
# short would leave dpkg half-configured).
BESIDE_PIDS=()
BESIDE_LOGS=()
beside() {  # beside NAME COMMAND...: run COMMAND in the background
  local log
  log=$(mktemp)
  echo "install: $1 (beside the Python packages)"
  ("${@:2}") >"$log" 2>&1 &
  BESIDE_PIDS+=($!)
  BESIDE_LOGS+=("$log")
}
wait_beside() {
  local i failed=0
  for i in "${!BESIDE_PIDS[@]}"; do
    if wait "${BESIDE_PIDS[$i]}"; then
      cat "${BESIDE_LOGS[$i]}"
    else
      cat "${BESIDE_LOGS[$i]}" >&2
      failed=1
    fi
    rm -f "${BESIDE_LOGS[$i]}"
  done
  BESIDE_PIDS=()
  return "$failed"
}
trap 'wait' EXIT

# 0. A Python to make the environment with: 3.11 or newer.
if ! command -v "$BASE" >/dev/null; then
  echo "install: no $BASE on PATH; install Python 3.11 or newer (or set BASE_PYTHON)" >&2
  exit 1
fi
if ! "$BASE" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "install: $BASE is $("$BASE" -V 2>&1); this project needs Python 3.11 or newer (set BASE_PYTHON)" >&2
  exit 1
fi

# 1. The virtual environment. Debian and Ubuntu ship venv's pip bootstrap (ensurepip) in a package
# of its own, python3.X-venv.
if [ ! -x "$PY" ]; then
  echo "install: a virtual environment in $VENV ($("$BASE" -V 2>&1))"
  if ! "$BASE" -m venv "$VENV" >/dev/null 2>&1; then
    rm -rf "$VENV"
    apt_install "python$("$BASE" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv"
    "$BASE" -m venv "$VENV"
  fi
fi

# 2. Only for the tests: the Debian packages they run. openssl: a test signs a stand-in Kubernetes
# API certificate; chromium + chromium-driver: the episode viewer's browser test drives headless
# Chromium with selenium; prometheus: a real server scrapes our /metrics and promtool checks the
# rules; postgresql: the gateways' shared record store (its tests start their own server with
# initdb); haproxy: the front `bcstack up --gateways N` balances them with. The demo needs none.
# And checkov, the IaC scanner the chart's presets are checked with (tests/test_chart_presets.py), goes in
# an environment of its own under .cache/tools: its pins (packaging, networkx, ...) would otherwise
# move this package's. Both run beside steps 3-8 (`beside`, above).
CHECKOV_VERSION=3.3.30
CHECKOV=.cache/tools/checkov
install_checkov() {
  echo "install: checkov==$CHECKOV_VERSION (in $CHECKOV)"
  "$PY" -m venv "$CHECKOV"
  "$CHECKOV/bin/pip" install --disable-pip-version-check -q "checkov==$CHECKOV_VERSION"
}
if [ "$FOR" = test ]; then
  beside "Debian packages for the tests" apt_install prometheus openssl chromium chromium-driver postgresql haproxy
  if [ "$("$CHECKOV/bin/checkov" --version 2>/dev/null)" != "$CHECKOV_VERSION" ]; then
    beside "checkov" install_checkov
  fi
fi

# 3. pip itself at the pinned version (constraints.txt): the pip a new venv starts with (ensurepip's,
# 23.2 with Python 3.11.7) took 58.6 s of the 2-core box to install this package's dependencies
# with nothing compiled, pip 26.3 41.4 s. And steps 4-5 install without compiling (`--no-compile`):
# step 6 compiles what they wrote on every core, where pip compiles one file after another (torch
# and the dependencies took 17.9 + 86.5 s with pip's compiling, 5.5 + 58.6 s without; 2026-12-07).
# From nothing, both together: bench/results/install.md.
want_pip=$(sed -n 's/^pip==//p' constraints.txt)
if [ "$("$PY" -m pip --version 2>/dev/null | cut -d' ' -f2)" != "$want_pip" ]; then
  "$PY" -m pip install --disable-pip-version-check -q -c constraints.txt "pip==$want_pip"
fi
INSTALLED=$(mktemp)  # what pip writes after this is newer: step 6 compiles it
trap 'rm -f "$INSTALLED"; wait' EXIT

# 4. torch first, the CPU build, before anything that depends on it.
want_torch=$(sed -n 's/^torch==//p' constraints.txt)
have_torch=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have_torch" != "$want_torch" ]; then
  echo "install: torch==$want_torch (CPU)"
  "${PIP[@]}" "torch==$want_torch"
fi

# 5. The package itself (editable, so `bcstack` runs this checkout) with its dev extras.
# (setuptools' build of the editable wheel warns that a folder named as a package may shadow it,
# which is how an editable install works; pip 26 prints the build's warnings.)
echo "install: browsecomp-stack and its dependencies"
PYTHONWARNINGS="ignore:Editable installation" "${PIP[@]}" -e '.[all,dev]'

# 6. Bytecode for every Python file steps 4-5 wrote (none, and no time, when they installed nothing),
# a compileall process per core on batches of files: where PYTHONDONTWRITEBYTECODE is set, a module
# without it is compiled again at every import, in every process. As pip's own compiling, a file that
# does not compile (a test fixture of some package) is passed over: it is not imported.
find "$VENV/lib" -name '*.py' -cnewer "$INSTALLED" -print0 |
  xargs -0 -r -P "$(nproc)" -n 2000 "$PY" -m compileall -qq || true

# 7. Guard: nothing may have replaced the CPU torch or pulled torchvision.
"$PY" - <<'PY'
import importlib.util, sys
import torch
if torch.version.cuda is not None or not torch.__version__.startswith("2.13.0"):
    sys.exit(f"install: torch {torch.__version__} (cuda={torch.version.cuda}) is not the pinned CPU build")
if importlib.util.find_spec("torchvision") is not None:
    sys.exit("install: torchvision is installed; it does not import beside the CPU torch. pip uninstall torchvision")
PY
if [ "$FOR" = test ]; then
  # 8. SGLang's wheels (the chart's pinned version and the newest release), for the contract tests:
  # downloaded once into .cache/sglang/<version>/ with `pip download --no-deps`, never installed.
  "$PY" -m devkit.sglang.source
fi
# 9. What ran beside steps 3-8 (the Debian packages, checkov) has finished, and succeeded.
wait_beside || { echo "install: a step run beside the Python packages failed (its output is above)" >&2; exit 1; }
echo "install: done ($FOR, in $VENV)"
