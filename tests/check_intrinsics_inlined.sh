#!/usr/bin/env bash
# Fails if mtpx's compiled library calls a std::arch intrinsic out of line.
#
# `bash tests/check_intrinsics_inlined.sh path/to/libmtpx.rlib`, on a library built with
# `-C target-cpu=x86-64` (no SIMD feature enabled globally). An intrinsic is inlined only into a
# function that enables every feature it needs; otherwise it is compiled as a function of its
# own and called once per use, in the middle of a kernel's loop. That is a silent slowdown on
# exactly the CPUs the kernel was written for (it happened to the AVX-512 BF16 attention's
# masked loads, which needed `avx512vl` their functions did not enable). A local symbol under
# `core::core_arch` in the library's objects is such an out-of-line copy.
set -euo pipefail
lib=${1:?usage: check_intrinsics_inlined.sh LIBMTPX_RLIB}
[ -f "$lib" ] || { echo "no such file: $lib" >&2; exit 2; }
# `_xgetbv` is std's feature detection, called out of line by design.
found=$(nm -C "$lib" 2>/dev/null | awk '$2 ~ /^[tT]$/' | grep -E 'core::core_arch::(x86|x86_64|aarch64|arm_shared)::' \
    | grep -v '_xgetbv' | sed 's/^[0-9a-f]* [tT] //' | sort -u || true)
if [ -n "$found" ]; then
    echo "intrinsics compiled out of line in $lib (their callers lack a target feature they need):" >&2
    echo "$found" >&2
    exit 1
fi
echo "no intrinsic is called out of line in $(basename "$lib")" >&2
