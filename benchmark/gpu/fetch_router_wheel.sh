#!/usr/bin/env bash
# sglang-router for the GPU test machine's PD group (test_pd_gpu starts a prefill and a decode server behind
# it; the machine has no router, so on 2026-11-30 its three pairs failed with "No module named
# 'sglang_router'"). The wheel (31 MB, a 92 MB Rust library with its symbols) does not fit beside the
# others in the device tool's 64 MiB, so this writes .whl/sglang_router-VERSION.tar.xz (~17 MB): the package
# with its library stripped of the symbols it never loads (strip --strip-unneeded keeps the dynamic ones;
# checked here: `sglang_router.launch_router` imports from it), which run_gpu_checks.sh unpacks into .site.
# Beside it, as wheels, what the router imports that the machine may lack (~3 MB): setproctitle, aiohttp
# and aiohttp's own dependencies. With Mooncake's trimmed wheel and the others, .whl is ~47 MiB and the
# checkout ~15 MiB. Run from the project's root after ../shared/gpu/fetch-offline-wheels.sh (and
# benchmark/gpu/fetch_mooncake_wheel.sh); VERSION defaults to the one installed here.
set -euo pipefail
VERSION=${1:-$(python3 -c 'import importlib.metadata as m; print(m.version("sglang-router"))' 2>/dev/null ||
  .venv/bin/python -c 'import importlib.metadata as m; print(m.version("sglang-router"))')}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$1" "${@:2}"
}
mkdir -p .whl
download .whl setproctitle aiohttp multidict yarl frozenlist aiosignal propcache aiohappyeyeballs attrs idna
download "$tmp" "sglang-router==$VERSION"
mkdir "$tmp/pkg"
(cd "$tmp/pkg" && python3 -m zipfile -e "$tmp"/sglang_router-*.whl . && strip --strip-unneeded sglang_router/*.so)
tar -C "$tmp/pkg" -cf - . | xz -9 -T0 > ".whl/sglang_router-$VERSION.tar.xz"
echo ".whl/sglang_router-$VERSION.tar.xz: $(($(stat -c %s ".whl/sglang_router-$VERSION.tar.xz") >> 20)) MiB"
du -sh .whl
