"""Filling a model's FP8 projections from a checkpoint: `prepare` gives each quantized `LoraLinear` an
`Fp8Weight`, `Fp8Sink` takes the checkpoint tensors that belong to FP8 weights.

Fused projections (q/k/v, gate/up) keep each part's scales: per-tensor scales become per-row scales over the
part's rows, per-channel scales stay per row, block grids are stacked where every part starts on a block row
and spread over rows otherwise (weight.py). A module the model keeps dense (lm_head; a fused projection with
one part left unquantized) but the checkpoint stores in FP8 is dequantized into the model's dtype at load.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import module_path
from .formats import Fp8Scheme
from .weight import FP8, Fp8Weight, dequantize, quantize_rows

if TYPE_CHECKING:
    from ..llama import LlamaForCausalLM

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)


@dataclass(frozen=True)
class Part:
    """One checkpoint module's rows in an FP8 weight."""
    weight: Fp8Weight
    row: int
    rows: int
    index: int   # which part of the fused projection (its input_scale entry)


def _parts(model: "LlamaForCausalLM"):
    """(layer's LoraLinear, [(checkpoint module, first row, rows)]) for every projection."""
    c = model.config
    for i, layer in enumerate(model.layers):
        for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            row, parts = 0, []
            for name in proj.parts:
                rows = c.projection_shape(name)[1]
                parts.append((module_path(i, name), row, rows))
                row += rows
            yield proj, parts


def prepare(model: "LlamaForCausalLM", scheme: Fp8Scheme) -> None:
    """Give each projection whose parts are all stored (or to be quantized) in FP8 an uninitialised Fp8Weight in
    place of its weight, on the model's device (meta, before `to_empty`, so no dense copy is ever allocated)."""
    for proj, parts in _parts(model):
        if not all(scheme.quantized(name) for name, _, _ in parts):
            continue
        cols = proj.weight.shape[1]
        block = (1, cols)   # per-row scales
        if scheme.block is not None:
            bn, bk = scheme.block
            block = (bn, bk) if all(row % bn == 0 for _, row, _ in parts) else (1, bk)
        proj.use_fp8(block, parts=len(parts), input_scale=scheme.static_input)


def fp8_parts(model: "LlamaForCausalLM") -> dict[str, Part]:
    """The checkpoint modules whose rows the model's FP8 weights hold, by name."""
    taken: dict[str, Part] = {}
    for proj, parts in _parts(model):
        if isinstance(proj.weight, Fp8Weight):
            for index, (name, row, rows) in enumerate(parts):
                taken[name] = Part(proj.weight, row, rows, index)
    return taken


def quantize_model(model: "LlamaForCausalLM") -> None:
    """Quantize every decoder projection of a model with dense weights (random-weight models), per row."""
    for proj, _ in _parts(model):
        q, s = quantize_rows(proj.weight)
        w = proj.use_fp8((1, q.shape[1]), parts=len(proj.parts), input_scale=False)
        w.qweight.copy_(q)
        w.scale.copy_(s)


@dataclass
class Fp8Sink:
    """Takes the checkpoint tensors of FP8 weights, checks them and writes them in; `finish` checks that every
    one came and hands back the dequantized FP8 tensors of modules the model keeps dense."""

    scheme: Fp8Scheme
    parts: dict[str, Part]
    filled: set[str] = field(default_factory=set)
    _dense: dict[str, dict[str, tuple[Path, torch.Tensor]]] = field(default_factory=dict)

    def takes(self, key: str) -> bool:
        """Is checkpoint tensor `key` this sink's: any tensor of an FP8 part but its bias, or any scale?"""
        module, _, suffix = key.rpartition(".")
        if module in self.parts:
            return suffix != "bias"
        return suffix in (self.scheme.scale_key, "input_scale", "weight_zero_point", "input_zero_point")

    def put(self, path: Path, key: str, tensor: torch.Tensor) -> None:
        """Take one tensor: an FP8 part's weight or scale is written into its Fp8Weight; a stored-FP8 weight or a
        scale of a module served dense is kept for `finish` (the loader hands over weights it finds in FP8)."""
        module, _, suffix = key.rpartition(".")
        if key in self.filled:
            raise ValueError(f"{path}: tensor {key!r} appears twice in the checkpoint")
        self.filled.add(key)
        part = self.parts.get(module)
        if suffix.endswith("zero_point"):
            _check_zero(path, key, tensor)
        elif part is None:   # stored in FP8, served dense (input scales of such modules are not needed)
            if suffix in ("weight", self.scheme.scale_key):
                self._dense.setdefault(module, {})[suffix] = (path, tensor)
        elif suffix == "weight":
            self._put_weight(path, key, part, tensor)
        elif suffix == self.scheme.scale_key and self.scheme.source != "quantize":
            self._put_scale(path, key, part, tensor)
        elif suffix == "input_scale" and self.scheme.static_input:
            part.weight.input_scale[part.index] = _scalar(path, key, tensor)
        else:
            raise ValueError(f"{path}: tensor {key!r} is not part of the {self.scheme.source} FP8 format "
                             f"this config describes")

    def _put_weight(self, path: Path, key: str, part: Part, tensor: torch.Tensor) -> None:
        expect = (part.rows, part.weight.shape[1])
        if tuple(tensor.shape) != expect:
            raise ValueError(f"{path}: tensor {key!r} has shape {list(tensor.shape)}; the config gives {list(expect)}")
        rows = slice(part.row, part.row + part.rows)
        if self.scheme.source == "quantize":
            if not tensor.is_floating_point() or tensor.dtype in (FP8, torch.float8_e5m2):
                raise ValueError(f"{path}: tensor {key!r} is {tensor.dtype}; quantization='fp8' takes a "
                                 f"float32, float16 or bfloat16 checkpoint")
            if not torch.isfinite(tensor).all():
                raise ValueError(f"{path}: tensor {key!r} has NaN or inf values")
            q, s = quantize_rows(tensor.to(part.weight.qweight.device))
            part.weight.qweight[rows] = q
            part.weight.scale[rows] = s
            return
        if tensor.dtype != FP8:
            raise ValueError(f"{path}: tensor {key!r} is {tensor.dtype}; the {self.scheme.source} config gives "
                             f"float8_e4m3fn weights")
        part.weight.qweight[rows] = tensor

    def _put_scale(self, path: Path, key: str, part: Part, tensor: torch.Tensor) -> None:
        w = part.weight
        scale = _scale(path, key, tensor)
        rows = slice(part.row, part.row + part.rows)
        if self.scheme.block is None:   # compressed-tensors: per tensor or per channel, kept per row
            if scale.numel() == 1:
                w.scale[rows] = scale.reshape(())
            elif tuple(scale.shape) == (part.rows, 1):
                w.scale[rows] = scale
            else:
                raise ValueError(f"{path}: tensor {key!r} has shape {list(scale.shape)}; expected [] or [1] (per "
                                 f"tensor) or {[part.rows, 1]} (per channel)")
            return
        bn, bk = self.scheme.block
        grid = (-(-part.rows // bn), -(-w.shape[1] // bk))
        if tuple(scale.shape) != grid:
            raise ValueError(f"{path}: tensor {key!r} has shape {list(scale.shape)}; weight_block_size "
                             f"{[bn, bk]} gives {list(grid)}")
        if w.block[0] == bn:   # the part starts on a block row: its grid is a slice of the weight's
            w.scale[part.row // bn:part.row // bn + grid[0]] = scale
        else:
            w.scale[rows] = scale.repeat_interleave(bn, dim=0)[:part.rows]

    def finish(self, folder: Path) -> list[tuple[Path, str, torch.Tensor]]:
        """Check that every FP8 tensor came; (file, key, dequantized weight) of each module kept dense."""
        suffixes = ["weight"]
        if self.scheme.source != "quantize":
            suffixes.append(self.scheme.scale_key)
        if self.scheme.static_input:
            suffixes.append("input_scale")
        for name in self.parts:
            for key in (f"{name}.{suffix}" for suffix in suffixes):
                if key not in self.filled:
                    raise ValueError(f"{folder}: the checkpoint has no tensor {key!r} ({self.scheme.source} FP8)")
        dense = []
        for module, got in self._dense.items():
            if "weight" not in got:
                raise ValueError(f"{got[self.scheme.scale_key][0]}: tensor {module + '.' + self.scheme.scale_key!r} "
                                 f"scales a weight the checkpoint does not store in FP8")
            if self.scheme.scale_key not in got:
                raise ValueError(f"{folder}: the checkpoint has no tensor {module + '.' + self.scheme.scale_key!r}")
            path, q = got["weight"]
            dense.append((path, f"{module}.weight", self._dequantize(path, module, q, got[self.scheme.scale_key][1])))
        return dense

    def _dequantize(self, path: Path, module: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """fp32 weight of a module stored in FP8 and served dense."""
        if q.dtype != FP8:
            raise ValueError(f"{path}: tensor {module + '.weight'!r} is {q.dtype}; the config gives float8_e4m3fn")
        scale = _scale(path, f"{module}.{self.scheme.scale_key}", scale)
        if self.scheme.block is not None:
            block = self.scheme.block
        elif scale.numel() == 1:   # per tensor
            scale, block = scale.reshape(1, 1), tuple(q.shape)
        else:                      # per channel
            block = (1, q.shape[1])
        grid = (-(-q.shape[0] // block[0]), -(-q.shape[1] // block[1]))
        if tuple(scale.shape) != grid:
            raise ValueError(f"{path}: the scale of {module!r} has shape {list(scale.shape)}; "
                             f"its weight {list(q.shape)} needs {list(grid)}")
        return dequantize(q, scale, block)


def _scale(path: Path, key: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in SCALE_DTYPES:
        raise ValueError(f"{path}: tensor {key!r} is {tensor.dtype}; scales are float32, bfloat16, float16 or e8m0")
    scale = tensor.to(torch.float32)
    if not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError(f"{path}: tensor {key!r} has scales that are not finite and positive")
    return scale


def _scalar(path: Path, key: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() != 1:
        raise ValueError(f"{path}: tensor {key!r} has shape {list(tensor.shape)}; expected [] or [1] (per tensor)")
    return _scale(path, key, tensor).reshape(())


def _check_zero(path: Path, key: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or tensor.dtype in (torch.int8, torch.int32, torch.int64, torch.uint8):
        if (tensor.to(torch.float32) == 0).all():
            return
    raise ValueError(f"{path}: tensor {key!r} holds nonzero zero points; only symmetric FP8 weights are served")
