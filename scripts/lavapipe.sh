#!/usr/bin/env bash
# Mesa's lavapipe (a Vulkan driver that runs on the CPU) and the Vulkan loader, from Debian's
# packages into a cache directory, for testing CubeCL kernels through wgpu without a GPU.
# Prints the environment to use:   eval "$(bash scripts/lavapipe.sh)"
set -euo pipefail
cache="${BURN_ZERO_LAVAPIPE:-$HOME/.cache/burn-zero-lavapipe}"
lib="$cache/root/usr/lib/x86_64-linux-gnu"
if [ ! -f "$lib/libvulkan_lvp.so" ] || [ ! -f "$lib/libvulkan.so.1" ]; then
  mkdir -p "$cache/debs" && cd "$cache/debs"
  apt-get download mesa-vulkan-drivers libvulkan1 >&2 \
    || { apt-get update -qq >&2 && apt-get download mesa-vulkan-drivers libvulkan1 >&2; }
  for deb in *.deb; do dpkg-deb -x "$deb" "$cache/root"; done
fi
missing=$(ldd "$lib/libvulkan_lvp.so" | grep "not found" || true)
[ -z "$missing" ] || { echo "lavapipe needs libraries this machine lacks: $missing" >&2; exit 1; }
cat > "$cache/lvp_icd.json" <<JSON
{"file_format_version": "1.0.0", "ICD": {"library_path": "$lib/libvulkan_lvp.so", "api_version": "1.1.230"}}
JSON
echo "export VK_ICD_FILENAMES=$cache/lvp_icd.json LD_LIBRARY_PATH=$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
