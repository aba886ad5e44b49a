# Sourced by the gpu_*.sh device scripts: Triton's compile cache between device calls (a fresh machine spent
# ~90 s of its ~110 s engine start-up compiling). `restore_triton_cache` unpacks the repo root's
# .triton-cache.tgz (git-ignored; carry it) if there is one; `save_triton_cache` leaves the cache in $OUT in
# 15 MB parts (triton-cache.tgz.part-aa, -ab, ...: a file over 16 MiB does not come back from the device),
# which `cat` joins into .triton-cache.tgz again. The device returns at most ~32 MB in all, so a cache packed
# larger (GPU test runs compile hundreds of variants) is not saved: part of one would be useless. Only
# binaries and metadata are packed (a cache of 715 kernels was 53 MB with its IR, 2026-12-01).
CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
CACHE_LIMIT_BYTES=$((30 * 1024 * 1024))

restore_triton_cache() {
  if [ -f .triton-cache.tgz ]; then
    mkdir -p "$CACHE_DIR" && tar -xzf .triton-cache.tgz -C "$CACHE_DIR" && echo "== Triton cache: $(ls "$CACHE_DIR" | wc -l) entries"
  fi
}

save_triton_cache() {
  local packed=/tmp/triton-cache-out.tgz
  # only what a cache hit reads: the binary (.cubin), the metadata (.json) and the launcher stubs (.so); the
  # intermediate IR and PTX (~80% of the bytes) are skipped (Triton's get_group returns the files that exist)
  (cd "$CACHE_DIR" && find . -type f \( -name '*.cubin' -o -name '*.json' -o -name '*.so' \) -print0 \
      | tar -czf "$packed" --null -T -) 2>/dev/null || return 0
  if [ "$(stat -c %s "$packed")" -gt "$CACHE_LIMIT_BYTES" ]; then
    echo "== Triton cache not saved: $(stat -c %s "$packed") bytes packed, over $CACHE_LIMIT_BYTES"
  else
    split -b 15m "$packed" "$OUT/triton-cache.tgz.part-" && ls -la "$OUT"/triton-cache.tgz.part-*
  fi
  rm -f "$packed"
}

# The device scripts' common start: the cache restored and src importable. `left`: the seconds to DEADLINE (a
# script's own default, else 540), after which a script starts no new part.
gpu_script_start() {
  restore_triton_cache
  export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
}

left() { echo $((${DEADLINE:-540} - SECONDS)); }
