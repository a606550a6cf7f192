#!/usr/bin/env bash
# Build, on the CPU machine, the peers' wheels for the GPU machine (Python 3.12, torch 2.11,
# transformers 5.17 on its image; vLLM 0.26.0 and Ray come with the vLLM carry's chunks).
# Pinned versions; only what the device image lacks (its pip freeze has the rest):
#   DIR/trl/     trl 1.16.0, datasets 5.2.0, multiprocess 0.70.19               (~3 MB)
#   DIR/verl/    verl 0.9.1, its own transformers 5.9.0 (verl wants <5.11) with tokenizers 0.22.2
#                (transformers 5.9 refuses the image's tokenizers 0.23.2 at import), and what its
#                trainer path imports that the image and the vLLM carry lack: TransferQueue (the
#                V1 trainer), tensordict + pyvers, hydra/omegaconf/antlr4, codetiming, torchdata,
#                datasets + multiprocess, orjson; pylatexenc and mathruler for its reward module.
#                jmespath and supervisor: vLLM 0.26.0's OpenAI server (which verl's vLLM replica imports)
#                needs them through model_hosting_container_standards; the agentrl carry never imports it.
#                No wandb (the harness logs to console and file): ~15 MB.
# Each folder is one device call's carry (at most 64 MiB with the working tree).
# Usage, from the project root (DIR git-ignored, e.g. `echo /.peers/ >> .git/info/exclude`):
#   bash bench/peers/build_carry.sh .peers
set -euo pipefail
DIR="$(mkdir -p "${1:-.peers}" && cd "${1:-.peers}" && pwd)"
PIPDL=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
       --platform manylinux_2_34_x86_64 --platform linux_x86_64 --platform any)
rm -rf "$DIR/trl" "$DIR/verl"; mkdir -p "$DIR/trl" "$DIR/verl"
"${PIPDL[@]}" -d "$DIR/trl" trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19
"${PIPDL[@]}" -d "$DIR/verl" verl==0.9.1 transformers==5.9.0 tokenizers==0.22.2 transferqueue==0.1.11 \
  tensordict==0.10.0 pyvers==0.1.0 hydra-core==1.3.2 omegaconf==2.3.0 codetiming==1.4.0 torchdata==0.11.0 \
  datasets==5.2.0 multiprocess==0.70.19 orjson==3.11.4 pylatexenc==2.11 mathruler==0.1.0 \
  jmespath==1.0.1 supervisor==4.3.0
# omegaconf pins antlr4-python3-runtime 4.9.*, published only as source: build its (pure Python) wheel here
python3 -m pip wheel -q --no-deps -w "$DIR/verl" antlr4-python3-runtime==4.9.3
echo "== carry sizes (each folder is one call; at most 64 MiB = 67108864 bytes with the working tree)"
du -sb "$DIR/trl" "$DIR/verl"
