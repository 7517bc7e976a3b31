#!/usr/bin/env bash
# Mooncake's host-memory build for the GPU test machine's PD group (test_pd_gpu's staged pairs), trimmed to
# fit the device tool's 64 MiB of checkout plus wheels: the wheel (46 MB, Python 3.12) less the files a
# transfer engine never loads (its benchmark, the store's client / master binaries, the store's module and
# a second copy of the etcd wrapper only they use), ~25 MB. Checked on this machine's Python 3.11 build with
# the same files removed: `mooncake.engine.TransferEngine` starts and moves a buffer between two engines.
# The CUDA build (`mooncake-transfer-engine`, 98 MB) does not fit; the staged path is what runs there.
# Run from the project's root after ../shared/gpu/fetch-offline-wheels.sh; the wheel lands in .whl/.
set -euo pipefail
VERSION=${1:-0.3.13.post1}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$tmp" "mooncake-transfer-engine-non-cuda==$VERSION"
mkdir -p .whl
python3 - "$tmp"/mooncake_transfer_engine_non_cuda-*.whl .whl <<'PY'
import os, re, sys, zipfile
src, out_dir = sys.argv[1], sys.argv[2]
drop = re.compile(
    r"^mooncake/(transfer_engine_bench|mooncake_client|mooncake_master|store\.so)$"
    r"|^mooncake_transfer_engine_non_cuda\.libs/libetcd_wrapper-[0-9a-f]+\.so$"
)
dst = os.path.join(out_dir, os.path.basename(src))
kept = dropped = 0
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if drop.match(info.filename):
            dropped += 1
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines()
            data = ("\n".join(l for l in lines if not drop.match(l.split(",", 1)[0])) + "\n").encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
        kept += 1
print(f"{dst}: {kept} files kept, {dropped} left out, {os.path.getsize(dst) >> 20} MiB")
PY
