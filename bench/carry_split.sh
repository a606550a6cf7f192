#!/usr/bin/env bash
# The vLLM carry's first chunk (.carry/c1, ~62 MB) and the working tree must fit one device call's 64 MiB, and
# the device counts more than the files' bytes (2026-11-28: 4.5 MiB of tracked files, 5.6 MiB by `du`, and
# c1 plus the tree was refused). This splits c1's archive in two so that the first piece travels alone and the
# second with c3 (28 MB). On the CPU machine, from the repo root, once after build_carry.sh:
#   bash bench/carry_split.sh            # -> .carry/c1a/part00 (56 MB), .carry/c1b/part01 (the rest, ~6 MB: c3 + c1b leave room for .peers/verl, 18 MB)
# Then the three calls, back to back (each within 30 s of the previous one's end):
#   carry [".carry/c1a"]   cp .carry/c1a/part00 /tmp/c1part00
#   carry [".carry/c2"]    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/c2/whl/*.whl && python3 .carry/c2/unpack.py .carry/c2/fa3.tar.xz /tmp/site
#   carry [".carry/c3", ".carry/c1b", ...]
#                          cat /tmp/c1part00 .carry/c1b/part01 > /tmp/vllm_c.tar.xz && python3 .carry/c3/unpack.py /tmp/vllm_c.tar.xz /tmp/site && rm /tmp/vllm_c.tar.xz /tmp/c1part00 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/c3/whl/*.whl && python3 .carry/c3/unpack.py .carry/c3/ray.tar.xz /tmp/site && <your work>
set -euo pipefail
src=${1:-.carry}
[ -f "$src/c1/vllm_c.tar.xz" ] || { echo "carry_split: $src/c1/vllm_c.tar.xz is missing (build the vLLM carry into $src first)"; exit 2; }
rm -rf "$src/c1a" "$src/c1b"; mkdir -p "$src/c1a" "$src/c1b"
split -b 56000000 -d "$src/c1/vllm_c.tar.xz" "$src/c1a/part"
mv "$src/c1a/part01" "$src/c1b/"
[ ! -e "$src/c1a/part02" ] || { echo "carry_split: c1 is over 100 MB: more than two pieces"; exit 2; }
cat "$src/c1a/part00" "$src/c1b/part01" | cmp - "$src/c1/vllm_c.tar.xz"
du -b "$src/c1a/part00" "$src/c1b/part01"
