#!/usr/bin/env bash
# `make smoke`: install the wheel that `make dist` built into a fresh virtualenv outside the checkout,
# with the versions pinned in constraints.txt and the flax extra, and run scripts/smoke_wheel.py there,
# from another folder, so that nothing is imported from the source tree. Then the other route that
# works before jaxckpt is on PyPI: a clone, installed with `pip install ".[flax]"` (built from its
# source tree) into another fresh virtualenv, and checked the same way, less the wheel's contents.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
shopt -s nullglob
wheels=("$repo"/dist/jaxckpt-*.whl)
if [ "${#wheels[@]}" -ne 1 ]; then
    echo "smoke: expected exactly one wheel in $repo/dist (run make dist first), found ${#wheels[@]}" >&2
    exit 1
fi
wheel="${wheels[0]}"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
"$python" -m venv "$tmp/venv"
# The wheel, its dependencies and the flax extra (flax, optax) at the pinned versions; pip's cache
# makes this a copy after the first run.
"$tmp/venv/bin/python" -m pip install -qq --disable-pip-version-check -c "$repo/constraints.txt" "$wheel[flax]"
echo "smoke: installed $(basename "$wheel") into a fresh virtualenv in $((SECONDS - start)) s"

cp -r "$repo/tests/golden" "$tmp/golden"
cp "$repo/scripts/smoke_wheel.py" "$tmp/"
mkdir "$tmp/work"
cd "$tmp/work"
JAX_PLATFORMS=cpu "$tmp/venv/bin/python" -W error::DeprecationWarning "$tmp/smoke_wheel.py" \
    --wheel "$wheel" --source "$repo/jaxckpt" --golden "$tmp/golden"

# A clone: the files that git tracks here, and new ones it does not ignore (so that uncommitted
# changes are tried too), copied without .venv, dist or build outputs.
clone="$tmp/clone"
mkdir "$clone"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard | tar --null --files-from=- --ignore-failed-read -cf -) \
    | tar -xf - -C "$clone"
"$python" -m venv "$tmp/clone-venv"
# pip builds the package in an isolated environment: PIP_CONSTRAINT pins its setuptools too.
(cd "$clone" && PIP_CONSTRAINT="$repo/constraints.txt" "$tmp/clone-venv/bin/python" -m pip install -qq \
    --disable-pip-version-check -c "$repo/constraints.txt" ".[flax]")
echo "smoke: installed the clone (pip install \".[flax]\") into a fresh virtualenv"
mkdir "$tmp/clone-work"
cd "$tmp/clone-work"
JAX_PLATFORMS=cpu "$tmp/clone-venv/bin/python" -W error::DeprecationWarning "$tmp/smoke_wheel.py" \
    --checkout "$clone" --source "$repo/jaxckpt" --golden "$tmp/golden"
echo "smoke: done in $((SECONDS - start)) s"
