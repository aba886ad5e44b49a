# Sourced by the gpu_*.sh device scripts: Triton's compile cache between device calls (a fresh machine spent
# ~90 s of its ~110 s engine start-up compiling). `restore_triton_cache` unpacks the repo root's
# .triton-cache.tgz (git-ignored; carry it) if there is one; `save_triton_cache` leaves the cache in $OUT in
# 15 MB parts (triton-cache.tgz.part-aa, -ab, ...: a file over 16 MiB does not come back from the device),
# which `cat` joins into .triton-cache.tgz again.
CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}

restore_triton_cache() {
  if [ -f .triton-cache.tgz ]; then
    mkdir -p "$CACHE_DIR" && tar -xzf .triton-cache.tgz -C "$CACHE_DIR" && echo "== Triton cache: $(ls "$CACHE_DIR" | wc -l) entries"
  fi
}

save_triton_cache() {
  tar -czf - -C "$CACHE_DIR" . 2>/dev/null | split -b 15m - "$OUT/triton-cache.tgz.part-" && ls -la "$OUT"/triton-cache.tgz.part-*
}
