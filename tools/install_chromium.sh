#!/usr/bin/env bash
# A headless Chromium for the HTML report's test (tests/conformance/test_report_html.py loads report.html with
# `chromium --headless --dump-dom`, which runs its script). Idempotent:
#
#   bash tools/install_chromium.sh
#
# - does nothing when a chromium, chromium-browser, google-chrome or google-chrome-stable binary is on PATH;
# - on Debian or Ubuntu installs the `chromium` package with apt-get (as root, or through sudo when it is there);
# - elsewhere says what to install and exits 1.
# Without Chromium the test skips with the reason; under K3_STRICT=1 it fails.
set -euo pipefail

for name in chromium chromium-browser google-chrome google-chrome-stable; do
    if path=$(command -v "$name"); then
        echo "install_chromium: $path is already here; nothing to do"
        exit 0
    fi
done

if ! command -v apt-get >/dev/null; then
    echo "install_chromium: no apt-get here; install Chromium or Google Chrome with this system's package" \
         "manager so that one of chromium, chromium-browser, google-chrome is on PATH" >&2
    exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null; then
    SUDO="sudo"
else
    echo "install_chromium: apt-get needs root, and sudo is not here; run this script as root" >&2
    exit 1
fi

# Debian ships the browser as `chromium`; Ubuntu's chromium-browser package is a snap wrapper that does not run in
# a container, hence Debian's name first.
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
if ! $SUDO apt-get install -y -q --no-install-recommends chromium; then
    $SUDO apt-get install -y -q --no-install-recommends chromium-browser
fi

for name in chromium chromium-browser; do
    if path=$(command -v "$name"); then
        echo "install_chromium: installed $path ($("$path" --version 2>/dev/null || echo 'version unknown'))"
        exit 0
    fi
done
echo "install_chromium: apt-get finished but no chromium binary is on PATH" >&2
exit 1
