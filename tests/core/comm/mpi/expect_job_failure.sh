#!/bin/sh
# Usage: expect_job_failure.sh <max seconds> <regex or ""> <command...>
# Passes when the command exits non-zero within <max seconds> and its output matches the regex.
max=$1 pattern=$2
shift 2
start=$(date +%s)
out=$("$@" 2>&1)
rc=$?
elapsed=$(( $(date +%s) - start ))
printf '%s\n' "$out"
echo "expect_job_failure: exit status $rc after ${elapsed}s"
[ "$rc" -ne 0 ] || { echo "FAIL: the job succeeded"; exit 1; }
[ "$elapsed" -le "$max" ] || { echo "FAIL: the job took more than ${max}s to end"; exit 1; }
if [ -n "$pattern" ] && ! printf '%s\n' "$out" | grep -Eq "$pattern"; then
  echo "FAIL: no line matches: $pattern"
  exit 1
fi
echo PASS
