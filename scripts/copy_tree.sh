#!/usr/bin/env bash
# Copies the working tree (tracked and untracked files git does not ignore, uncommitted work
# included) to DEST, for a build against another torch than the development venv's. DEST's .venv,
# build/ and built extension are kept, so that a second run rebuilds only what changed.
set -euo pipefail
dest=${1:?usage: copy_tree.sh DEST}
cd "$(dirname "$0")/.."
mkdir -p "$dest"
find "$dest" -mindepth 1 -maxdepth 1 ! -name '.venv' ! -name build ! -name ckpt_offload -exec rm -rf {} +
find "$dest/ckpt_offload" -mindepth 1 ! -name '_C*.so' ! -name _build_info.py -delete 2>/dev/null || true
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$dest"
