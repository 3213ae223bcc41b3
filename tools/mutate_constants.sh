#!/usr/bin/env bash
# Proves the test suite pins the spec's constants: each mutation below, applied to a scratch copy of the
# tree, must make at least one test fail. Prints one line per mutation; exits 1 if any mutant survives.
# Usage: bash tools/mutate_constants.sh   (from the repo root, after `make setup`)
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
py="$root/.venv/bin/python"
survived=0
mutate() {  # name, file, python-regex, replacement
    local name=$1 file=$2 pat=$3 rep=$4 tmp
    tmp=$(mktemp -d)
    cp -r "$root/k3ref" "$root/k3torch" "$root/conformance" "$root/k3cuda" "$root/tests" "$root/golden" "$root/pyproject.toml" "$tmp/"
    "$py" - "$tmp/$file" "$pat" "$rep" <<'PY' || { echo "$name: pattern not found"; survived=1; rm -rf "$tmp"; return; }
import re, sys
path, pat, rep = sys.argv[1:]
src = open(path).read()
new, n = re.subn(pat, rep, src, count=1)
sys.exit(0 if n else 1) if n == 0 else open(path, "w").write(new)
PY
    if (cd "$tmp" && PYTHONPATH="$tmp" "$py" -m pytest -q -x -p no:cacheprovider tests/k3ref/test_kda.py tests/k3ref/test_mla.py \
            tests/k3ref/test_mxfp4.py tests/conformance/test_conformance_cases.py >/dev/null 2>&1); then
        echo "SURVIVED  $name"; survived=1
    else
        echo "caught    $name"
    fi
    rm -rf "$tmp"
}
mutate "KDA L2 eps 1e-6 -> 1e-12"      k3ref/kda.py   'KDA_L2_EPS = 1e-6'                  'KDA_L2_EPS = 1e-12'
mutate "gate lower bound -5 -> -4"      k3ref/kda.py   'KDA_GATE_LOWER_BOUND = -5.0'        'KDA_GATE_LOWER_BOUND = -4.0'
mutate "MLA scale 1/sqrt(192) -> 128"   k3ref/mla.py   'math.sqrt\(self.qk_head_dim\)'      'math.sqrt(self.qk_nope_head_dim)'
mutate "MXFP4 nibbles high first"       k3ref/mxfp4.py '\[p & 0x0F, p >> 4\]'               '[p >> 4, p \& 0x0F]'
exit $survived
