#!/usr/bin/env bash
# System tools the test suite uses besides Python: Debian's Prometheus (the dashboard tests
# start a real server and check every PromQL expression with promtool) and Chromium (the
# compare report test opens the HTML report headless and checks a screenshot). Installed with
# apt-get when missing and this user may (root, or sudo without a password); otherwise
# says what to install, and the tests that need them fail under OTELKV_REQUIRE_FLEET_TESTS.
set -euo pipefail

missing=()
packages=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v promtool >/dev/null 2>&1 || missing+=(promtool)
[ ${#missing[@]} -gt 0 ] && packages+=(prometheus)
command -v chromium >/dev/null 2>&1 || { missing+=(chromium); packages+=(chromium); }
[ ${#missing[@]} -eq 0 ] && exit 0

if command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        SUDO=()
    elif sudo -n true >/dev/null 2>&1; then
        SUDO=(sudo -n)
    else
        echo "system-tools: ${missing[*]} missing and apt-get needs root: apt-get install ${packages[*]}" >&2
        exit 0
    fi
    echo "system-tools: installing Debian's ${packages[*]} (for the dashboard and compare report tests)" >&2
    "${SUDO[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends \
        "${packages[@]}" >/dev/null
else
    echo "system-tools: ${missing[*]} missing (install Prometheus 2.x: prometheus and promtool; Chromium)" >&2
fi
