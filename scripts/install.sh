#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: Debian packages, CPU torch, this package with its
# dev extras. Every pip step uses constraints.txt so nothing can swap the CPU torch for a
# CUDA build. Re-running it when everything is in place takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
PIP=("$PY" -m pip install --disable-pip-version-check -q -c constraints.txt)
# openssl: a test signs a stand-in Kubernetes API certificate; chromium + chromium-driver: the
# episode viewer's browser test (tests/test_viewer_browser.py) drives headless Chromium with selenium;
# postgresql: the gateways' shared record store (`bcstack up --records postgres`, its tests start
# their own server with initdb); haproxy: the front `bcstack up --gateways N` balances them with.
APT_PACKAGES=(prometheus openssl chromium chromium-driver postgresql haproxy)

# 1. Debian packages the tests use (a real Prometheus server scrapes our /metrics; openssl).
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "install: apt packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The Debian package starts a system Prometheus where an init system runs; tests start their own.
  $SUDO service prometheus stop >/dev/null 2>&1 || true
  $SUDO service postgresql stop >/dev/null 2>&1 || true
  $SUDO service haproxy stop >/dev/null 2>&1 || true
fi

# 2. torch first, the CPU build, before anything that depends on it.
want_torch=$(sed -n 's/^torch==//p' constraints.txt)
have_torch=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have_torch" != "$want_torch" ]; then
  echo "install: torch==$want_torch (CPU)"
  "${PIP[@]}" "torch==$want_torch"
fi

# 3. The package itself (editable, so `bcstack` runs this checkout) with its dev extras.
echo "install: browsecomp-stack and its dependencies"
"${PIP[@]}" -e '.[all,dev]'

# 4. Guard: nothing may have replaced the CPU torch or pulled torchvision.
"$PY" - <<'PY'
import importlib.util, sys
import torch
if torch.version.cuda is not None or not torch.__version__.startswith("2.13.0"):
    sys.exit(f"install: torch {torch.__version__} (cuda={torch.version.cuda}) is not the pinned CPU build")
if importlib.util.find_spec("torchvision") is not None:
    sys.exit("install: torchvision is installed; it does not import beside the CPU torch. pip uninstall torchvision")
PY
# 5. SGLang's wheels (the chart's pinned version and the newest release), for the contract tests:
# downloaded once into .cache/sglang/<version>/ with `pip download --no-deps`, never installed.
"$PY" -m devkit.sglang.source
# 6. checkov, the IaC scanner the chart's presets are checked with (tests/test_chart_presets.py), in
# an environment of its own under .cache/tools: its pins (packaging, networkx, ...) would otherwise
# move this package's.
CHECKOV_VERSION=3.3.30
CHECKOV=.cache/tools/checkov
if [ "$("$CHECKOV/bin/checkov" --version 2>/dev/null)" != "$CHECKOV_VERSION" ]; then
  echo "install: checkov==$CHECKOV_VERSION (in $CHECKOV)"
  "$PY" -m venv "$CHECKOV"
  "$CHECKOV/bin/pip" install --disable-pip-version-check -q "checkov==$CHECKOV_VERSION"
fi
echo "install: done"
