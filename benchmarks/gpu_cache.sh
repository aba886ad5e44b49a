# Sourced by the gpu_*.sh device scripts: Triton's compile cache between device calls (a fresh machine spent
# ~90 s of its ~110 s engine start-up compiling). `restore_triton_cache` unpacks the repo root's
# .triton-cache.tgz (git-ignored; carry it) if there is one; `save_triton_cache` leaves in $OUT, in 15 MB parts
# (triton-cache.tgz.part-aa, -ab, ...: a file over 16 MiB does not come back from the device), only the entries
# compiled since the restore (all of them without one), so a grown cache still comes back (the whole one reached
# 33.8 MB on 2026-12-02, past the ~32 MB the device returns). Merge them into the carried cache here:
#   mkdir -p /tmp/tc && tar -xzf .triton-cache.tgz -C /tmp/tc && cat $FILES_AT/triton-cache.tgz.part-* \
#       | tar -xz -C /tmp/tc && tar -czf .triton-cache.tgz -C /tmp/tc .
# Only binaries and metadata are packed (a cache of 715 kernels was 53 MB with its IR, 2026-12-01).
CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
CACHE_LIMIT_BYTES=$((30 * 1024 * 1024))

CACHE_MARK=/tmp/triton-cache-restored

restore_triton_cache() {
  if [ -f .triton-cache.tgz ]; then
    mkdir -p "$CACHE_DIR" && tar -xzf .triton-cache.tgz -C "$CACHE_DIR" && echo "== Triton cache: $(ls "$CACHE_DIR" | wc -l) entries"
    sleep 1 && touch "$CACHE_MARK"   # what is compiled after this is what save_triton_cache packs
  fi
}

save_triton_cache() {
  local packed=/tmp/triton-cache-out.tgz
  # only what a cache hit reads: the binary (.cubin), the metadata (.json) and the launcher stubs (.so); the
  # intermediate IR and PTX (~80% of the bytes) are skipped (Triton's get_group returns the files that exist)
  local newer=()
  [ -f "$CACHE_MARK" ] && newer=(-newer "$CACHE_MARK")
  (cd "$CACHE_DIR" && find . -type f ${newer[@]+"${newer[@]}"} \( -name '*.cubin' -o -name '*.json' -o -name '*.so' \) -print0 \
      | tar -czf "$packed" --null -T -) 2>/dev/null || { bundle_out; return 0; }
  if [ "$(stat -c %s "$packed")" -gt "$CACHE_LIMIT_BYTES" ]; then
    echo "== Triton cache not saved: $(stat -c %s "$packed") bytes packed, over $CACHE_LIMIT_BYTES"
  else
    split -b 15m "$packed" "$OUT/triton-cache.tgz.part-" && ls -la "$OUT"/triton-cache.tgz.part-*
  fi
  rm -f "$packed"
  bundle_out
}

# At most 8 files come back from $OUT (the eighteenth session lost its cache part to that): with more, every
# file but the cache parts goes into $OUT/results.tgz (unpack it here: tar -xzf results.tgz). Only for an $OUT
# outside the repo (the device's): a script run here with the default OUT=benchmarks/results packs nothing.
bundle_out() {
  local out repo
  out=$(realpath -m "$OUT") repo=$(realpath .)
  case "$out/" in "$repo"/*) return 0 ;; esac
  [ "$(find "$out" -type f | wc -l)" -le 8 ] && return 0
  (cd "$out" && find . -type f ! -name 'triton-cache.tgz.part-*' ! -name results.tgz -print0 | sort -z \
      | tar -czf results.tgz --null -T - --remove-files) \
      && echo "== results packed into results.tgz: $(tar -tzf "$out/results.tgz" | tr '\n' ' ')"
}

# The device scripts' common start: the cache restored and src importable. `left`: the seconds to DEADLINE (a
# script's own default, else 540), after which a script starts no new part.
gpu_script_start() {
  restore_triton_cache
  export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
}

left() { echo $((${DEADLINE:-540} - SECONDS)); }

# `gpu_tests LOG SECONDS PYTEST_ARGS...`: the GPU tests named, at most SECONDS, their log in $OUT/LOG (-rA: a log
# cut by the limit still names what passed), the summary lines shown; TESTS=0 skips them.
gpu_tests() {
  [ "${TESTS:-1}" = 1 ] || return 0
  local log=$1 limit=$2
  shift 2
  echo "== GPU tests at ${SECONDS}s"
  timeout "$limit" python -m pytest -m gpu -q -rA -p no:cacheprovider "$@" 2>&1 | tee "$OUT/$log" \
      | grep -E "FAILED|ERROR|passed|failed" | tail -12
}

# `engine_each VAR TAG VALUE...`: issue 5's benchmark at batch 32 (backbone and distinct adapters, 3 runs each,
# CUDA graphs) once per VALUE of the environment variable VAR, each in its own process, while time is left;
# results in $OUT/engine_TAG_VALUE.{json,md}. ENGINE_ARGS: more bench_engine.py arguments (word-split);
# REPEATS: runs per variant (3).
engine_each() {
  local var=$1 tag=$2 value
  shift 2
  for value in "$@"; do
    [ "$(left)" -gt 100 ] || break
    echo "== engine, $var=$value at ${SECONDS}s"
    env "$var=$value" timeout $(($(left) - 5)) python benchmarks/bench_engine.py --batches 32 --modes graphs \
        --variants backbone,distinct --repeats "${REPEATS:-3}" --out "$OUT/engine_${tag}_$value.json" \
        --md "$OUT/engine_${tag}_$value.md" ${ENGINE_ARGS:-} 2>&1 | grep -E "^\| 32|Error"
  done
}
