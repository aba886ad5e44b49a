# Sourced by the gpu_*.sh launchers, which run from the repository root on a lent GPU machine and write their
# results under $OUT (default benchmarks/results). It makes src importable, installs carried wheels (.whl/, from
# fetch_device_wheels.sh) when there are any, and restores Triton's compile cache from the repository root's
# .triton-cache.tar.xz (git-ignored; carry it) so that a fresh machine does not spend minutes compiling (xz: the
# kernels' variants differ little, and its large window packs them ~8x smaller than gzip).
# `finish` (every launcher's last line) leaves the newly compiled cache entries in $OUT/triton-cache-N.tar.xz, and
# packs every other file of $OUT into $OUT/results_N.tgz when there are more than come back from the device (8).
# Merge the returned cache into the carried one here:
#   mkdir -p /tmp/tc && for f in .triton-cache.tar.xz FILES_AT/triton-cache-*.tar.xz; do tar -xJf $f -C /tmp/tc; done \
#       && tar -cf - -C /tmp/tc . | xz -9 -T0 >.triton-cache.tar.xz
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
CACHE_MARK=/tmp/triton-cache-restored

# `left`: seconds to DEADLINE (default 570 of a 600-second call), after which a launcher starts nothing new
left() { echo $((${DEADLINE:-570} - SECONDS)); }

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
if [ -f .triton-cache.tar.xz ]; then
  mkdir -p "$CACHE_DIR" && tar -xJf .triton-cache.tar.xz -C "$CACHE_DIR" && echo "== Triton cache: $(ls "$CACHE_DIR" | wc -l) entries"
  sleep 1 && touch "$CACHE_MARK"   # what is compiled after this is what `finish` packs
fi

finish() {
  local packed=/tmp/triton-cache-out.tar.xz list=/tmp/triton-cache-new newer=() out repo
  rm -f "$list"
  [ -f "$CACHE_MARK" ] && newer=(-newer "$CACHE_MARK")
  # only what a cache hit reads (binaries, metadata, launcher stubs), not the IR: ~20% of the bytes
  [ -d "$CACHE_DIR" ] && (cd "$CACHE_DIR" && find . -type f ${newer[@]+"${newer[@]}"} \
      \( -name '*.cubin' -o -name '*.json' -o -name '*.so' \) -print0 >"$list")
  # xz -6 -T0: blocks small enough for every core (-9's one large block took over a minute on ~1,000 new entries)
  if [ -s "$list" ] && (cd "$CACHE_DIR" && tar -cf - --null -T "$list" | xz -6 -T0 >"$packed") 2>/dev/null; then
    if [ "$(stat -c %s "$packed")" -le $((30 << 20)) ]; then
      local k=1
      while [ -e "$OUT/triton-cache-$k.tar.xz" ]; do k=$((k + 1)); done   # one per launcher of a call
      mv "$packed" "$OUT/triton-cache-$k.tar.xz"
    else
      echo "== Triton cache not saved: $(stat -c %s "$packed") bytes packed"
    fi
    rm -f "$packed"
  fi
  out=$(realpath -m "$OUT") repo=$(realpath .)
  case "$out/" in "$repo"/*) return 0 ;; esac   # results written into the repository: nothing to pack
  [ "$(find "$out" -type f | wc -l)" -le 8 ] && return 0
  local n=1
  while [ -e "$out/results_$n.tgz" ]; do n=$((n + 1)); done   # a later launcher in the same $OUT packs anew
  (cd "$out" && find . -type f ! -name 'triton-cache-*.tar.xz' ! -name 'results_*.tgz' -print0 | sort -z \
      | tar -czf "results_$n.tgz" --null -T - --remove-files) \
      && echo "== results packed into results_$n.tgz: $(tar -tzf "$out/results_$n.tgz" | tr '\n' ' ')"
}
