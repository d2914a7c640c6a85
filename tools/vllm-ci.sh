#!/usr/bin/env bash
# The guard as a CI job of vLLM's repository runs it (docs/ci.md), as one
# plain script: in the Python environment where vLLM is installed (an
# editable install of the checkout under test, or a release),
#
#   tools/vllm-ci.sh [PYTHON]      (PYTHON: that environment's interpreter,
#                                   default python3 on PATH)
#
# 1. installs this package (REPLAY_PACKAGE: a path, a wheel or a git URL;
#    default this script's checkout; REPLAY_INSTALL=0 when it is installed
#    already), pip's output in $OUT/pip.log;
# 2. from an empty directory, `replay test --coordinator vllm --junit-xml`
#    on the corpus shipped inside the package, and checks the XML parses;
# 3. the same corpus as pytest runs it (`pytest --replay-corpus`);
# 4. the drift check, REPLAY_RANDOM random configurations (default 100) of
#    seed REPLAY_SEED (default 0); a difference is written to
#    $OUT/drift.parquet, ready to commit as a regression trace.
# OUT (default ./replay-ci) receives the reports. Exit 0 when every step
# passes, else the first failing step's status. This project's CI runs it
# against the vLLM 0.33.0 environment (`make test-vllm`), so the recipe in
# docs/ci.md cannot rot.
set -uo pipefail
PY=${1:-python3}
# A path to the interpreter is made absolute: the steps run from an empty directory.
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
HERE=$(cd "$(dirname "$0")/.." && pwd)
PACKAGE=${REPLAY_PACKAGE:-$HERE}
OUT=$(mkdir -p "${OUT:-replay-ci}" && cd "${OUT:-replay-ci}" && pwd)
RANDOM_N=${REPLAY_RANDOM:-100}
SEED=${REPLAY_SEED:-0}
status=0
# run WHAT COMMAND...: one line before, the command's own output, one after.
run() {
  local what=$1 t0 rc
  shift
  t0=$(date +%s)
  echo "vllm-ci: $what"
  "$@"
  rc=$?
  echo "vllm-ci: $what: exit $rc ($(( $(date +%s) - t0 )) s)"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

version=$("$PY" -c 'from importlib.metadata import version; print(version("vllm"))') || {
  echo "vllm-ci: vLLM is not installed in $PY's environment" >&2
  exit 2
}
echo "vllm-ci: vLLM $version in $PY; reports in $OUT"
if [ "${REPLAY_INSTALL:-1}" != 0 ]; then
  echo "vllm-ci: installing $PACKAGE (pip's output: $OUT/pip.log)"
  "$PY" -m pip install "$PACKAGE" > "$OUT/pip.log" 2>&1 || {
    echo "vllm-ci: the install failed; the last lines of $OUT/pip.log:" >&2
    tail -n 20 "$OUT/pip.log" >&2
    exit 2
  }
fi
# From an empty directory: nothing of this checkout is needed.
EMPTY=$(mktemp -d)
trap 'rm -rf "$EMPTY"' EXIT
cd "$EMPTY" || exit 2

run "replay test --coordinator vllm --junit-xml (the shipped corpus)" \
  "$PY" -m replay test --coordinator vllm --junit-xml "$OUT/replay-junit.xml"
run "the JUnit report parses" "$PY" - "$OUT/replay-junit.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot().find("testsuite")
cases = suite.findall("testcase")
assert len(cases) == int(suite.get("tests")) > 0, (len(cases), suite.attrib)
failed = [c.get("name") for c in cases if c.find("failure") is not None]
print(f"{len(cases)} test cases, {len(failed)} failed, {suite.get('skipped')} skipped")
PY
run "pytest --replay-corpus --replay-coordinator vllm" \
  "$PY" -m pytest -q -p no:cacheprovider --replay-corpus --replay-coordinator vllm \
  --junitxml "$OUT/pytest-junit.xml"
run "replay test --coordinator vllm --random $RANDOM_N --seed $SEED (drift)" \
  "$PY" -m replay test --coordinator vllm --random "$RANDOM_N" --seed "$SEED" \
  -o "$OUT/drift.parquet"
exit "$status"
