# Sourced by the gpu_*.sh device scripts: Triton's compile cache between device calls (a fresh machine spent
# ~90 s of its ~110 s engine start-up compiling). `restore_triton_cache` unpacks the repo root's
# .triton-cache.tgz (git-ignored; carry it) if there is one; `save_triton_cache` leaves the cache in $OUT in
# 15 MB parts (triton-cache.tgz.part-aa, -ab, ...: a file over 16 MiB does not come back from the device),
# which `cat` joins into .triton-cache.tgz again. The device returns at most ~32 MB in all, so a cache packed
# larger (GPU test runs compile hundreds of variants) is not saved: part of one would be useless.
CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
CACHE_LIMIT_BYTES=$((30 * 1024 * 1024))

restore_triton_cache() {
  if [ -f .triton-cache.tgz ]; then
    mkdir -p "$CACHE_DIR" && tar -xzf .triton-cache.tgz -C "$CACHE_DIR" && echo "== Triton cache: $(ls "$CACHE_DIR" | wc -l) entries"
  fi
}

save_triton_cache() {
  local packed=/tmp/triton-cache-out.tgz
  tar -czf "$packed" -C "$CACHE_DIR" . 2>/dev/null || return 0
  if [ "$(stat -c %s "$packed")" -gt "$CACHE_LIMIT_BYTES" ]; then
    echo "== Triton cache not saved: $(stat -c %s "$packed") bytes packed, over $CACHE_LIMIT_BYTES"
  else
    split -b 15m "$packed" "$OUT/triton-cache.tgz.part-" && ls -la "$OUT"/triton-cache.tgz.part-*
  fi
  rm -f "$packed"
}
