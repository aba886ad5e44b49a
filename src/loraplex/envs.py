"""Every environment variable loraplex reads, in one place (as vLLM's `envs.py`).

No other module reads `LORAPLEX_*` variables from `os.environ`: they call the accessors below. Each accessor
reads the environment when called and validates the value; a bad value is a ValueError that names the
variable, the value and the choices. Modules that need a setting at import (a Triton constexpr, a table of
tuned configs) call the accessor once then, so those settings must be set before loraplex is imported.

| variable                | default | choices                 | meaning                                                 |
|-------------------------|---------|-------------------------|---------------------------------------------------------|
| LORAPLEX_OPS_BACKEND    | auto    | auto, triton, reference | the ops' backend: Triton for CUDA tensors and the       |
|                         |         |                         | PyTorch reference otherwise (auto), or one forced       |
| LORAPLEX_PDL            | on      | on, off                 | programmatic dependent launch of the Triton kernels     |
|                         |         |                         | where the GPU has it (sm_90 on); read at import         |
| LORAPLEX_SKINNY_GEMM    | auto    | auto, on, off           | the projections' Triton GEMM for decode-sized batches:  |
|                         |         |                         | auto (16-bit weights on CUDA GPUs of sm_80 on), on      |
|                         |         |                         | (fp32 and Triton's interpreter too), off (cuBLAS        |
|                         |         |                         | everywhere); read at import                             |
| LORAPLEX_SKINNY_CONFIGS | (unset) | a JSON file's path      | tuned tiles of that GEMM per weight shape, replacing    |
|                         |         |                         | the bundled ops/gemm/tuned_h200.json; read at import    |
| LORAPLEX_FP8_W8A8       | auto    | auto, on, off           | GEMMs with FP8 weights on the FP8 tensor cores          |
|                         |         |                         | (activations quantized per row): auto (bf16 on Hopper   |
|                         |         |                         | GPUs), on (wherever torch._scaled_mm runs: the CPU      |
|                         |         |                         | too), off (weight-only: decode kernels convert the      |
|                         |         |                         | weight, prompts dequantize it); read at import          |
| LORAPLEX_FAST_LAUNCH    | auto    | auto, on, off           | ops/launch.py's direct kernel launches: auto (with the  |
|                         |         |                         | Triton versions they were checked against), on, or off  |
|                         |         |                         | (every launch through Triton: for debugging)            |

Two variables of other tools are read here too: TRITON_INTERPRET (Triton's CPU interpreter, which the kernels
follow as Triton does: ops/pdl.py) and TERM ("dumb": `loraplex demo` prints plain text, no terminal UI).

Switches (PDL, SKINNY_GEMM, FAST_LAUNCH) also take 1/true/yes for on and 0/false/no for off, in any case and
with blanks around. A variable set to the empty string counts as unset.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    choices: tuple[str, ...] | None   # None: free text (a path)
    switch: bool                       # on/off also spelled 1/true/yes, 0/false/no
    meaning: str


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("LORAPLEX_OPS_BACKEND", "auto", ("auto", "triton", "reference"), False,
             "the ops' backend: Triton for CUDA tensors and the PyTorch reference otherwise (auto), or one forced"),
    Variable("LORAPLEX_PDL", "on", ("on", "off"), True,
             "programmatic dependent launch of the Triton kernels where the GPU has it (compute capability 9.0 "
             "on); read at import"),
    Variable("LORAPLEX_SKINNY_GEMM", "auto", ("auto", "on", "off"), True,
             "the projections' Triton GEMM for decode-sized batches: auto (16-bit weights on CUDA GPUs of compute "
             "capability 8.0 on), on (also fp32 weights and Triton's interpreter), off (cuBLAS everywhere); read "
             "at import"),
    Variable("LORAPLEX_SKINNY_CONFIGS", "", None, False,
             "a JSON file of tuned tiles for that GEMM per weight shape ({\"N,K\": {SkinnyConfig's fields}}, as "
             "benchmarks/bench_skinny_gemm.py --configs-out writes), replacing the bundled "
             "ops/gemm/tuned_h200.json; read at import"),
    Variable("LORAPLEX_FP8_W8A8", "auto", ("auto", "on", "off"), True,
             "GEMMs with FP8 weights on the FP8 tensor cores, each row of the activations quantized by its amax "
             "(decode rows: the Triton kernel; prompts: torch._scaled_mm, a scale per output column): auto (bf16 "
             "activations on Hopper GPUs, compute capability 9.x), on (bf16 or fp16 wherever torch._scaled_mm "
             "runs, the CPU included), off (weight-only: the decode kernel converts the weight in registers, "
             "prompts' weights are dequantized for cuBLAS) (ops/gemm/fp8.py); read at import"),
    Variable("LORAPLEX_FAST_LAUNCH", "auto", ("auto", "on", "off"), True,
             "ops/launch.py's direct kernel launches: auto (with the Triton versions they were checked against), "
             "on, or off (every launch through Triton's own path: for debugging)"),
)}


def get(name: str) -> str:
    """The value in effect of the variable `name` (the default where unset or empty), normalized (lower case,
    on/off spelled so); ValueError for a value outside its choices."""
    var = VARIABLES[name]
    raw = os.environ.get(name, "")
    value = raw.strip()
    if not value:
        return var.default
    if var.choices is None:
        return value
    value = value.lower()
    if var.switch:
        value = "on" if value in _ON else "off" if value in _OFF else value
    if value not in var.choices:
        spelled = [f"{c} (or 1)" if var.switch and c == "on" else f"{c} (or 0)" if var.switch and c == "off" else c
                   for c in var.choices]
        raise ValueError(f"{name}={raw!r}: expected {', '.join(spelled[:-1])} or {spelled[-1]}")
    return value


def ops_backend() -> str:
    """LORAPLEX_OPS_BACKEND: "auto", "triton" or "reference"."""
    return get("LORAPLEX_OPS_BACKEND")


def pdl() -> bool:
    """LORAPLEX_PDL: whether programmatic dependent launch is wanted (ops/pdl.py adds: where the GPU has it)."""
    return get("LORAPLEX_PDL") == "on"


def triton_gemm() -> str:
    """LORAPLEX_SKINNY_GEMM: "auto", "on" or "off" (ops/gemm/skinny.py)."""
    return get("LORAPLEX_SKINNY_GEMM")


def gemm_configs_path() -> str | None:
    """LORAPLEX_SKINNY_CONFIGS: the tuned-tiles file to use instead of the bundled one, or None."""
    return get("LORAPLEX_SKINNY_CONFIGS") or None


def fp8_w8a8() -> str:
    """LORAPLEX_FP8_W8A8: "auto", "on" or "off" (ops/gemm/fp8.py)."""
    return get("LORAPLEX_FP8_W8A8")


def fast_launch() -> str:
    """LORAPLEX_FAST_LAUNCH: "auto", "on" or "off" (ops/launch.py)."""
    return get("LORAPLEX_FAST_LAUNCH")


def triton_interpret() -> bool:
    """TRITON_INTERPRET, as Triton reads it when kernels are decorated: its CPU interpreter runs them."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _ON


def dumb_terminal() -> bool:
    """TERM=dumb: the terminal cannot draw a full-screen UI."""
    return os.environ.get("TERM") == "dumb"


def snapshot() -> dict[str, str]:
    """Every variable's value in effect (defaults included; "" for an unset path), for benchmark records."""
    return {name: get(name) for name in VARIABLES}
