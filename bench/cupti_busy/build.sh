#!/usr/bin/env bash
# Builds the CUPTI busy-fraction injection library (busy.c) into .gpu/lib/libbusy.so, here with
# gcc, for the device tool's `carry [".gpu"]` (the device has no compiler we rely on).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu/lib
gcc -O2 -Wall -Wextra -Werror -shared -fPIC -o .gpu/lib/libbusy.so bench/cupti_busy/busy.c -ldl -lpthread
ls -la .gpu/lib/libbusy.so
