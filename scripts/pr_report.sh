#!/usr/bin/env bash
# A pull request's report: eaglenest report of HEAD against BASE, then `dvc metrics diff`, into OUT/report.md
# (the pull-request workflow runs it; so can anyone, in a checkout of the pull request).
#
# With a team remote in the environment (EAGLENEST_REMOTE_URL, e.g. s3://bucket/eaglenest; EAGLENEST_REMOTE_ENDPOINT
# for an S3 endpoint other than AWS; the credentials as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, which dvc-s3
# reads from the environment: the workflow gives it a key that can only read) it pulls the head's outputs first, so the report and the diffs read what was pushed,
# and says so. Without it (a fork's pull request gets no secrets) it reports from the files git tracks.
# Usage: scripts/pr_report.sh BASE [OUT]
set -euo pipefail
base="${1:?usage: scripts/pr_report.sh BASE [OUT]}"
out="${2:-report}"

if [ -n "${EAGLENEST_REMOTE_URL:-}" ]; then
    # .dvc/config.local: the runner's checkout only, never committed
    dvc remote add --local --force --default ci "$EAGLENEST_REMOTE_URL"
    if [ -n "${EAGLENEST_REMOTE_ENDPOINT:-}" ]; then
        dvc remote modify --local ci endpointurl "$EAGLENEST_REMOTE_ENDPOINT"
    fi
    dvc remote modify --local ci verify true  # an object changed in the store is refused, not reported on
    # the team's pull (dvc pull --run-cache, then prepare's caches); a failure is one line naming the remote
    if ! eaglenest remote pull --name ci > /dev/null; then
        echo "scripts/pr_report.sh: the line above says why the pull from $EAGLENEST_REMOTE_URL failed; check the" \
             "remote's secrets, or unset EAGLENEST_REMOTE_URL to report from tracked files" >&2
        exit 1
    fi
    source="the head's outputs pulled from the team remote"
else
    source="the files git tracks (no team remote configured: a fork's pull request gets no secrets)"
fi

eaglenest report "$base" HEAD --out "$out"
{
    echo
    echo "## dvc metrics diff"
    echo
    dvc metrics diff --md "$base" HEAD
    echo
    echo "Read from $source."
} >> "$out/report.md"
