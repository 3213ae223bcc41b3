#!/usr/bin/env bash
# The wheel as a user installs it: build it from this checkout, install it into a fresh virtual environment with
# its runtime dependencies only (numpy, safetensors, ml_dtypes, rich: no torch, no test tools), and run the main
# job from a folder outside the checkout, so that the committed goldens must come from the wheel
# (site-packages/k3conf_golden) and nothing from the source tree can stand in for a missing file.
#
# Passes when the wheel holds golden/MANIFEST.json and every golden it lists, the installed package reads its
# goldens from site-packages, and `k3conf run --backend numpy64 numpy32 --no-timing` exits 0 having judged cases
# on both backends (report.json: exit_code 0, no fail or error, passes on each backend).
#
# Usage: tools/wheel_check.sh [PYTHON]   (default: .venv/bin/python; it builds the wheel, so it needs
# setuptools >= 77, the pyproject's build requirement: `--no-build-isolation` uses the one installed).
# The fresh environment installs the runtime dependencies with pip (PyPI or pip's cache; PIP_* settings apply).
# Takes about a minute; prints the seconds each step took.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
py="${1:-$repo/.venv/bin/python}"
if [[ ! -x "$py" ]]; then
    echo "wheel_check: no python at $py; run \`make setup\` or pass one: tools/wheel_check.sh PYTHON" >&2
    exit 2
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/k3conf-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
step_start=$SECONDS
step() {   # one line per finished step: what it was and how long it took
    echo "wheel_check: $1 ($((SECONDS - step_start)) s)"
    step_start=$SECONDS
}
all_start=$SECONDS

# 1. the wheel, built from a copy of the checkout's files (tracked, and untracked but not ignored): a stale build/
# in the checkout cannot leak removed modules into the wheel, and the checkout is not written to
src="$repo"
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    src="$work/src"
    mkdir "$src"
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$src")
fi
"$py" -m pip wheel --no-deps --no-build-isolation -q -w "$work/dist" "$src" >"$work/build.log" 2>&1 || {
    cat "$work/build.log" >&2
    echo "wheel_check: building the wheel failed (log above)" >&2
    exit 1
}
wheel="$(ls "$work"/dist/k3_conformance-*.whl)"
step "built $(basename "$wheel")"

# 2. the wheel holds the manifest and every golden it lists
"$py" - "$wheel" "$repo/golden/MANIFEST.json" <<'EOF'
import json
import sys
import zipfile

wheel, manifest = sys.argv[1], sys.argv[2]
names = set(zipfile.ZipFile(wheel).namelist())
listed = ["MANIFEST.json", *json.load(open(manifest))["files"]]
missing = [f for f in listed if f"k3conf_golden/{f}" not in names]
if missing:
    sys.exit(f"wheel_check: {wheel} lacks {len(missing)} of the {len(listed)} golden files of {manifest}, "
             f"e.g. {missing[:3]}: see [tool.setuptools.package-data] in pyproject.toml")
print(f"wheel_check: the wheel holds the manifest and its {len(listed) - 1} goldens")
EOF

# 3. a fresh environment with the wheel and its runtime dependencies
"$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel"
if "$work/venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "wheel_check: torch is installed in the fresh environment; the wheel must not require it" >&2
    exit 1
fi
step "installed into a fresh environment"

# 4. the main job from a folder outside the checkout, reading the goldens the wheel installed
mkdir "$work/outside"
cd "$work/outside"
root="$("$work/venv/bin/python" -c "from conformance.golden.store import COMMITTED_ROOT; print(COMMITTED_ROOT)")"
case "$root" in
    "$work/venv/"*/site-packages/k3conf_golden) ;;
    *) echo "wheel_check: the installed package reads its goldens from $root, not from its site-packages" >&2
       exit 1 ;;
esac
status=0
"$work/venv/bin/k3conf" run --backend numpy64 numpy32 --no-timing --report "$work/outside/reports" \
    >"$work/run.log" 2>&1 || status=$?
if [[ $status -ne 0 ]]; then
    cat "$work/run.log" >&2
    echo "wheel_check: \`k3conf run --backend numpy64 numpy32 --no-timing\` exited $status from the wheel" >&2
    exit 1
fi
"$work/venv/bin/python" - "$work/outside/reports/report.json" <<'EOF'
import json
import sys
from collections import Counter

report = json.load(open(sys.argv[1]))
status = Counter((r["backend"], r["status"]) for r in report["results"])
bad = {k: n for k, n in status.items() if k[1] in ("fail", "error")}
passed = {b: status[(b, "pass")] for b in ("numpy64", "numpy32")}
if report["exit_code"] != 0 or bad or not all(passed.values()):
    sys.exit(f"wheel_check: report.json: exit_code {report['exit_code']}, failed/errored {bad}, passes {passed}")
print("wheel_check: judged " + ", ".join(f"{n} case(s) on {b}" for b, n in passed.items()) + ", all within gates")
EOF
step "k3conf run from the wheel"
echo "wheel_check: OK in $((SECONDS - all_start)) s"
