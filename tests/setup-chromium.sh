#!/usr/bin/env bash
# Install Debian's headless Chromium for the report's browser tests (tests/workflow/
# test_report_browser.py). Idempotent: does nothing when a chromium is already on PATH. Never fails
# the build: without root or apt the browser tests skip and say why.
set -u
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-chromium: not root or no apt-get; the browser tests will be skipped" >&2
    exit 0
fi
echo "setup-chromium: installing Debian's chromium (one time, ~1 min)" >&2
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >/tmp/setup-chromium.log 2>&1; then
    # A stale package index is the usual cause: refresh it once and retry.
    apt-get update >>/tmp/setup-chromium.log 2>&1
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >>/tmp/setup-chromium.log 2>&1 \
        || echo "setup-chromium: install failed (see /tmp/setup-chromium.log); the browser tests will be skipped" >&2
fi
exit 0
