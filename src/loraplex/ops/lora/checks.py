"""Argument checks shared by every backend: shapes, dtypes and devices, from metadata only.

Nothing here reads device memory. Values that live on the device (ranks, scalings) are
validated where they are written (the adapter pool), not per call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from .batch import LoraBatch

MAX_SLICES = 4
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]


@dataclass
class Slices:
    """The per-slice tensors of one call, as lists (a single pair is a list of one)."""

    lora_a: list[torch.Tensor] | None
    lora_b: list[torch.Tensor] | None
    ranks: list[torch.Tensor]
    scalings: list[torch.Tensor] | None

    @property
    def num(self) -> int:
        return len(self.ranks)


def _desc(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)}, {str(t.dtype).replace('torch.', '')} on {t.device}"


def _listify(value, name: str, single: bool) -> list:
    if single:
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a tensor when lora_a is a single tensor, got {type(value).__name__}")
        return [value]
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of tensors when lora_a is a list, got {type(value).__name__}")
    return list(value)


def _check_tensor(t, name: str, ndim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got {_desc(t)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def check_x(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be [T, K], got {_desc(x)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {_desc(x)}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name}'s rows must be contiguous (stride 1 along the last dimension), got {_desc(x)} "
                         f"with strides {x.stride()}")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but the LoRA ops are not differentiable: call them under "
                         f"torch.no_grad() or torch.inference_mode()")


def check_batch(batch: LoraBatch, x: torch.Tensor, num_slots: int) -> None:
    if not isinstance(batch, LoraBatch):
        raise ValueError(f"batch must be a LoraBatch, got {type(batch).__name__}")
    if batch.num_rows != x.shape[0]:
        raise ValueError(f"batch covers {batch.num_rows} rows but x has {x.shape[0]} rows ({_desc(x)})")
    if batch.device != x.device:
        raise ValueError(f"batch is on {batch.device} but x is on {x.device}")
    if batch.max_slot >= num_slots:
        raise ValueError(f"batch uses slot {batch.max_slot} but the adapter stacks have {num_slots} slots")


def check_slices(x: torch.Tensor, lora_a: TensorOrList | None, lora_b: TensorOrList | None, ranks,
                 scalings, *, a_given: bool = True, b_given: bool = True) -> tuple[Slices, int]:
    """Normalise to lists and check them against x; returns the slices and the slot count."""
    lead = lora_a if a_given else lora_b
    single = isinstance(lead, torch.Tensor)
    lists = {}
    for name, value, wanted in (("lora_a", lora_a, a_given), ("lora_b", lora_b, b_given),
                                ("ranks", ranks, True), ("scalings", scalings, b_given)):
        lists[name] = _listify(value, name, single) if wanted else None
    n = len(lists["ranks"])
    if n == 0:
        raise ValueError("lora_a/lora_b lists are empty: need at least one slice")
    if n > MAX_SLICES:
        raise ValueError(f"{n} slices given; one launch takes at most {MAX_SLICES}")
    for name, lst in lists.items():
        if lst is not None and len(lst) != n:
            raise ValueError(f"{name} has {len(lst)} entries but ranks has {n}: one per slice")
    suffix = (lambda i: "") if single else (lambda i: f"[{i}]")
    num_slots, rank_dim = None, None
    K = x.shape[1]
    for i in range(n):
        if a_given:
            a = lists["lora_a"][i]
            _check_tensor(a, f"lora_a{suffix(i)}", 3, x.device)
            if a.dtype != x.dtype:
                raise ValueError(f"lora_a{suffix(i)} is {a.dtype} but x is {x.dtype}")
            if a.shape[2] != K:
                raise ValueError(f"lora_a{suffix(i)} must be [num_slots, R, K={K}] to match x {list(x.shape)}, "
                                 f"got {_desc(a)}")
            if not a.is_contiguous():
                raise ValueError(f"lora_a{suffix(i)} must be contiguous ({_desc(a)}, strides {a.stride()})")
            num_slots = a.shape[0] if num_slots is None else num_slots
            rank_dim = a.shape[1] if rank_dim is None else rank_dim
            if (a.shape[0], a.shape[1]) != (num_slots, rank_dim):
                raise ValueError(f"lora_a{suffix(i)} has {_desc(a)}; every slice needs [num_slots={num_slots}, "
                                 f"R={rank_dim}, K]")
        if b_given:
            b = lists["lora_b"][i]
            _check_tensor(b, f"lora_b{suffix(i)}", 3, x.device)
            if b.dtype != x.dtype:
                raise ValueError(f"lora_b{suffix(i)} is {b.dtype} but x is {x.dtype}")
            num_slots = b.shape[0] if num_slots is None else num_slots
            rank_dim = b.shape[2] if rank_dim is None else rank_dim
            if b.shape[0] != num_slots or b.shape[2] != rank_dim:
                raise ValueError(f"lora_b{suffix(i)} must be [num_slots={num_slots}, N, R={rank_dim}] "
                                 f"(matching lora_a), got {_desc(b)}")
            if not b.is_contiguous():
                raise ValueError(f"lora_b{suffix(i)} must be contiguous ({_desc(b)}, strides {b.stride()})")
        r = lists["ranks"][i]
        _check_tensor(r, f"ranks{suffix(i)}", 1, x.device)
        if r.dtype != torch.int32 or r.shape[0] != num_slots or not r.is_contiguous():
            raise ValueError(f"ranks{suffix(i)} must be contiguous int32 [num_slots={num_slots}], got {_desc(r)}")
        if b_given:
            s = lists["scalings"][i]
            _check_tensor(s, f"scalings{suffix(i)}", 1, x.device)
            if s.dtype != torch.float32 or s.shape[0] != num_slots or not s.is_contiguous():
                raise ValueError(f"scalings{suffix(i)} must be contiguous float32 [num_slots={num_slots}], "
                                 f"got {_desc(s)}")
    return Slices(lists["lora_a"], lists["lora_b"], lists["ranks"], lists["scalings"]), num_slots


def check_y(y: torch.Tensor, x: torch.Tensor, lora_b: list[torch.Tensor], y_offset: int) -> None:
    if y is not x:
        check_x(y, "y")
    _check_tensor(y, "y", 2, x.device)
    if torch._debug_has_internal_overlap(y) == 1:
        raise ValueError(f"y has elements that share memory ({_desc(y)}, strides {y.stride()}): it is written in place")
    if y.dtype != x.dtype:
        raise ValueError(f"y is {y.dtype} but x is {x.dtype}")
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"y has {y.shape[0]} rows but x has {x.shape[0]} ({_desc(y)} vs {_desc(x)})")
    if not isinstance(y_offset, int) or isinstance(y_offset, bool) or y_offset < 0:
        raise ValueError(f"y_offset must be a non-negative int, got {y_offset!r}")
    widths = [b.shape[1] for b in lora_b]
    if y_offset + sum(widths) > y.shape[1]:
        raise ValueError(f"slices of widths {widths} from y_offset={y_offset} need {y_offset + sum(widths)} "
                         f"columns but y has {y.shape[1]} ({_desc(y)})")


def check_v(v: torch.Tensor, x_rows: int, num_slices: int, rank_dim: int, device: torch.device,
            single: bool, name: str = "v") -> None:
    """v is fp32 `[T, R]` when the stacks came as single tensors, `[slices, T, R]` when as lists."""
    want = [x_rows, rank_dim] if single else [num_slices, x_rows, rank_dim]
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    if v.device != device:
        raise ValueError(f"{name} is on {v.device} but the other tensors are on {device}")
    if v.dtype != torch.float32 or list(v.shape) != want or not v.is_contiguous():
        raise ValueError(f"{name} must be contiguous float32 {want}, got {_desc(v)}")
