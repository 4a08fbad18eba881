#!/usr/bin/env bash
# Builds fastckpt against another torch release and runs the test suite with it, without touching
# .venv or the in-place build: the GPU machine's image has an older torch than CI's pin, and
# engine behaviour that differs between releases shows up here first (torch 2.11 frees a custom
# Function's saved tensors once its outputs die; found this way). CUDA sources compile too.
# Usage: scripts/torch_compat.sh 2.11.0   (pip needs that release in its cache or index)
set -euo pipefail
version="${1:?usage: scripts/torch_compat.sh TORCH_VERSION}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${TMPDIR:-/tmp}/fastckpt-torch-$version"
if [ ! -x "$work/venv/bin/python" ]; then
  python3 -m venv "$work/venv"
  "$work/venv/bin/pip" install -q "torch==$version" numpy pytest ninja pybind11 setuptools
fi
rm -rf "$work/src"
git -C "$repo" worktree add -q --force --detach "$work/src" HEAD
trap 'git -C "$repo" worktree remove --force "$work/src"' EXIT
# uncommitted edits of tracked files travel too (new files must be committed first)
git -C "$repo" diff HEAD | git -C "$work/src" apply --allow-empty
cd "$work/src"
FASTCKPT_CUDA="${FASTCKPT_CUDA:-1}" MAX_JOBS="${MAX_JOBS:-2}" "$work/venv/bin/python" setup.py -q build_ext --inplace
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider
