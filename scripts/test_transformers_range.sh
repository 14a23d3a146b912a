#!/usr/bin/env bash
# Runs hf_dspark's tests against other transformers releases than the installed one. Each release goes into a folder
# of its own (`pip install --target`) put first on PYTHONPATH, so it shadows only transformers (and any dependency
# whose installed version that release does not accept); torch, the test extras and the shipped wheels are the
# installed ones. It works the same on the bare machine and inside a virtual environment.
#
#   bash scripts/test_transformers_range.sh                  # the oldest tested release, unless it is installed
#   bash scripts/test_transformers_range.sh 5.24.0 5.26.0    # these releases
#   FULL=1 bash scripts/test_transformers_range.sh           # every test, not the fast lane (what CI runs)
#
# By default it runs the fast lane (`-m "not slow and not install and not distributed"`: every test of the generate()
# routes, the engine, the pinned private signatures and the cache adapter; about 8 minutes on 2 cores), with FULL=1
# every test (about as long as the README's test command).
# To add a release to the tested set: run this with it, then add it to TESTED_TRANSFORMERS in
# hf_dspark/generation/routing/route_checks.py and widen the range there and in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
releases=("$@")
if [ ${#releases[@]} -eq 0 ]; then
    read -r oldest installed < <(python -c '
import transformers
from hf_dspark.generation.routing.route_checks import TESTED_TRANSFORMERS
print(TESTED_TRANSFORMERS[0], transformers.__version__)')
    if [ "$oldest" = "$installed" ]; then
        echo "transformers $installed, the oldest tested release, is installed: the README's test command covers it"
        exit 0
    fi
    releases=("$oldest")
fi

# The requirements of the transformers in folder $1 that the installed packages do not meet, one per line.
unmet_requirements='
import sys
from importlib.metadata import PackageNotFoundError, distributions, version

from packaging.requirements import Requirement

dist = next(d for d in distributions(path=[sys.argv[1]]) if d.metadata["Name"].lower() == "transformers")
for line in dist.requires or []:
    requirement = Requirement(line)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    try:
        if requirement.specifier.contains(version(requirement.name), prereleases=True):
            continue
    except PackageNotFoundError:
        pass
    print(f"{requirement.name}{requirement.specifier}")
'

work="${TMPDIR:-/tmp}/hf_dspark-transformers-range"
mkdir -p "$work"
pytest_args=(-q -p no:cacheprovider -m "not slow and not install and not distributed" tests)
lane="the fast lane"
if [ -n "${FULL:-}" ]; then
    pytest_args=(-q -p no:cacheprovider tests)
    lane="every test"
fi
pip_install=(python -m pip install --quiet --disable-pip-version-check --no-deps --upgrade)
status=0
for release in "${releases[@]}"; do
    overlay="$work/transformers-$release"
    if [ ! -f "$overlay/.complete" ]; then
        rm -rf "$overlay"
        "${pip_install[@]}" --target "$overlay" "transformers==$release"
        mapfile -t unmet < <(python -c "$unmet_requirements" "$overlay")
        if [ ${#unmet[@]} -gt 0 ]; then
            echo "transformers $release also needs: ${unmet[*]} (installed beside it)"
            "${pip_install[@]}" --target "$overlay" "${unmet[@]}"
        fi
        touch "$overlay/.complete"
    fi
    found="$(PYTHONPATH="$overlay" python -c 'import transformers; print(transformers.__version__)')"
    if [ "$found" != "$release" ]; then
        echo "with $overlay first on PYTHONPATH, python imports transformers $found, not $release" >&2
        exit 1
    fi
    echo "== transformers $release: $lane"
    # From the checkout: python imports this hf_dspark, and the overlay's transformers before the installed one.
    if ! (cd "$root" && PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}" python -m pytest "${pytest_args[@]}"); then
        echo "== transformers $release: FAILED" >&2
        status=1
    fi
done
exit $status
