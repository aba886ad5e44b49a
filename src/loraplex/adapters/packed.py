"""Many adapters in one safetensors file: validated once at `convert`, registered at once, read on demand.

Layout, for every layer `l` and projection `p` that any adapter touches:

    layers.{l}.{p}.lora_a    [rows, in]    every adapter's A, one block of `rank` rows each
    layers.{l}.{p}.lora_b_t  [rows, out]   every adapter's B transposed, same blocks

so each adapter's block in each tensor is `rank` contiguous rows, whatever its neighbours' ranks
(no padding to a common rank). `manifest.ranks` (int32), `manifest.scalings` (float32) and
`manifest.row_offsets` (int64), each `[adapters, layers, projections]`, say where each block is;
rank 0 means "not targeted". The header metadata holds the adapter names and sources, the base
model's shape and the dtype. A rank-`r` block of adapter `i` is rows
`row_offsets[i, l, p] : row_offsets[i, l, p] + r`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import torch

from ..models.config import PROJECTIONS, ModelConfig
from .peft_format import inspect_peft_adapter, read_peft_adapter
from .priority import HOST_PRIORITY
from .spec import (AdapterError, AdapterSpec, LoraAdapter, ModuleSpec, check_adapter_name, check_finite,
                   pack_host_adapter)

FORMAT = "loraplex-packed-lora"
VERSION = "1"
FILE_NAME = "adapters.safetensors"
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32",
              torch.int64: "I64"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _widest(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    dtypes = set(dtypes)
    if torch.float32 in dtypes or torch.float64 in dtypes or len(dtypes) > 1:
        return torch.float32
    return dtypes.pop() if dtypes else torch.float32


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def convert(model: ModelConfig, adapters: list[tuple[str, str | Path]], out_dir: str | Path, *,
            dtype: torch.dtype | None = None, progress: bool = True) -> Path:
    """Validate every adapter folder against `model` and write them into `out_dir/adapters.safetensors`.

    Streams one adapter at a time (memory stays at one adapter), into a temporary file that is
    renamed into place only when complete. `dtype=None` keeps the sources' precision (float32 when
    they differ).
    """
    from tqdm import tqdm
    names = [n for n, _ in adapters]
    for name in names:
        check_adapter_name(name)
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise AdapterError(f"adapter names given more than once: {', '.join(dupes)}")
    if not adapters:
        raise AdapterError("no adapters to convert")
    specs = [inspect_peft_adapter(folder, model, name=name)
             for name, folder in tqdm(adapters, desc="validating", unit="adapter", disable=not progress)]
    if dtype is None:
        dtype = _widest(s.weights_dtype for s in specs)
    L, P, n = model.num_hidden_layers, len(PROJECTIONS), len(specs)
    ranks = torch.zeros(n, L, P, dtype=torch.int32)
    scalings = torch.zeros(n, L, P, dtype=torch.float32)
    for i, spec in enumerate(specs):
        for (layer, proj), m in spec.modules.items():
            ranks[i, layer, PROJECTIONS.index(proj)] = m.rank
            scalings[i, layer, PROJECTIONS.index(proj)] = m.scaling
    row_offsets = (torch.cumsum(ranks.long(), 0) - ranks.long())  # exclusive prefix sum over adapters
    rows = ranks.long().sum(0)  # [L, P]

    header: dict = {}
    layout: list[tuple[str, torch.dtype, list[int]]] = [
        ("manifest.row_offsets", torch.int64, [n, L, P]), ("manifest.ranks", torch.int32, [n, L, P]),
        ("manifest.scalings", torch.float32, [n, L, P])]
    for layer in range(L):
        for p, proj in enumerate(PROJECTIONS):
            if rows[layer, p]:
                in_f, out_f = model.projection_shape(proj)
                layout.append((f"layers.{layer}.{proj}.lora_a", dtype, [int(rows[layer, p]), in_f]))
                layout.append((f"layers.{layer}.{proj}.lora_b_t", dtype, [int(rows[layer, p]), out_f]))
    offset = 0
    for name, dt, shape in layout:  # 8-, then 4-byte items first: every tensor stays aligned to its item size
        size = torch.Size(shape).numel() * torch.tensor([], dtype=dt).element_size()
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {
        "format": FORMAT, "version": VERSION, "dtype": _dtype_name(dtype),
        "model": json.dumps({"model_type": model.model_type, **{f: getattr(model, f) for f in SHAPE_FIELDS}}),
        "projections": json.dumps(list(PROJECTIONS)),
        "adapters": json.dumps([{"name": s.name, "source": s.source,
                                 "base_model_name_or_path": s.base_model_name_or_path} for s in specs]),
    }
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    data_start = 8 + len(blob)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final, tmp = out_dir / FILE_NAME, out_dir / f".{FILE_NAME}.{os.getpid()}.partial"
    try:
        with open(tmp, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            f.truncate(data_start + offset)
            for name, t in (("manifest.row_offsets", row_offsets), ("manifest.ranks", ranks),
                            ("manifest.scalings", scalings)):
                f.seek(data_start + header[name]["data_offsets"][0])
                f.write(_tensor_bytes(t))
            for i, spec in enumerate(tqdm(specs, desc="packing", unit="adapter", disable=not progress)):
                adapter = read_peft_adapter(spec, dtype)
                for (layer, proj), m in adapter.modules.items():
                    p = PROJECTIONS.index(proj)
                    start = int(row_offsets[i, layer, p])
                    for suffix, t in (("lora_a", m.a), ("lora_b_t", m.b.T)):
                        info = header[f"layers.{layer}.{proj}.{suffix}"]
                        row_bytes = info["shape"][1] * t.element_size()
                        f.seek(data_start + info["data_offsets"][0] + start * row_bytes)
                        f.write(_tensor_bytes(t))
            f.flush()
            os.fsync(f.fileno())  # the rename must not land before the data does
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


class PackedFile:
    """An opened packed file: one AdapterSpec per adapter, and a reader for each.

    The file is opened once and read with positioned reads from that descriptor, so replacing it
    on disk (a new `convert` into the same folder) cannot mix the old manifest with new data.
    """

    def __init__(self, path: str | Path, model: ModelConfig) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / FILE_NAME
        self.path, self.model = path, model
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise AdapterError(f"{path}: no such packed adapter file") from None
        except OSError as e:
            raise AdapterError(f"{path}: cannot open: {e}") from None
        try:
            self._open(model)
        except BaseException:
            self.close()
            raise

    def _open(self, model: ModelConfig) -> None:
        from safetensors.torch import load

        path = self.path
        size = os.fstat(self._fd).st_size
        raw_len = os.pread(self._fd, 8, 0)
        header_len = int.from_bytes(raw_len, "little") if len(raw_len) == 8 else -1
        if not 0 < header_len <= min(size - 8, 100_000_000):
            raise AdapterError(f"{path}: unreadable safetensors file: invalid header length")
        try:
            header = json.loads(os.pread(self._fd, header_len, 8))
            meta = header.get("__metadata__") or {}
        except (ValueError, AttributeError) as e:
            raise AdapterError(f"{path}: unreadable safetensors file: damaged header ({e})") from None
        if meta.get("format") != FORMAT:
            raise AdapterError(f"{path}: not a loraplex packed adapter file (metadata format={meta.get('format')!r})")
        if meta.get("version") != VERSION:
            raise AdapterError(f"{path}: packed format version {meta.get('version')!r}; this loraplex reads {VERSION}")
        self._data_start = 8 + header_len
        try:
            infos = {k: (v["dtype"], [int(d) for d in v["shape"]], [int(o) for o in v["data_offsets"]])
                     for k, v in header.items() if k != "__metadata__"}
            shape, entries = json.loads(meta["model"]), json.loads(meta["adapters"])
            projections, self.dtype = json.loads(meta["projections"]), DTYPES[meta["dtype"]]
            names = [e["name"] for e in entries]
            if not isinstance(shape, dict) or not all(isinstance(n, str) for n in names):
                raise TypeError("model must be an object and adapter names strings")
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise AdapterError(f"{path}: damaged manifest metadata ({type(e).__name__}: {e})") from None
        end = max((o[1] for _, _, o in infos.values()), default=0)
        if self._data_start + end != size:
            raise AdapterError(f"{path}: unreadable safetensors file: {size} bytes, but its header describes "
                               f"{self._data_start + end} (truncated or damaged)")
        for f in SHAPE_FIELDS:
            if shape.get(f) != getattr(model, f):
                raise AdapterError(f"{path}: packed for a model with {f}={shape.get(f)}, but the served model "
                                   f"has {f}={getattr(model, f)}")
        if projections != list(PROJECTIONS):
            raise AdapterError(f"{path}: projections {projections} differ from {list(PROJECTIONS)}")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise AdapterError(f"{path}: adapter names appear more than once: {', '.join(dupes)}")
        n, L, P = len(names), model.num_hidden_layers, len(PROJECTIONS)
        manifest = {}
        for name, dtype in (("manifest.ranks", "I32"), ("manifest.scalings", "F32"), ("manifest.row_offsets", "I64")):
            if name not in infos or infos[name][0] != dtype or infos[name][1] != [n, L, P]:
                raise AdapterError(f"{path}: tensor {name!r} must be {dtype} {[n, L, P]}, got "
                                   f"{infos[name][:2] if name in infos else 'nothing'}")
            begin, stop = infos[name][2]
            manifest.update(load(_header_for(name, infos[name]) + os.pread(self._fd, stop - begin,
                                                                           self._data_start + begin)))
        self.ranks, self.scalings = manifest["manifest.ranks"], manifest["manifest.scalings"]
        self.row_offsets = manifest["manifest.row_offsets"]
        self._tensors = self._check_blocks(infos)
        self._offsets = self.row_offsets.tolist()  # Python lists: indexing a tensor per element is slow
        ranks, scalings = self.ranks.tolist(), self.scalings.tolist()
        self.specs = []
        for i, e in enumerate(entries):
            modules = {(layer, proj): ModuleSpec(ranks[i][layer][p], scalings[i][layer][p])
                       for layer in range(L) for p, proj in enumerate(PROJECTIONS) if ranks[i][layer][p] > 0}
            self.specs.append(AdapterSpec(name=e["name"], source=f"{path}#{e['name']}", modules=modules,
                                          base_model_name_or_path=e.get("base_model_name_or_path"),
                                          locator=i, weights_dtype=self.dtype))

    def _check_blocks(self, infos: dict) -> dict[str, tuple[int, int]]:
        """Every adapter's block lies inside its tensor and overlaps no other; returns (offset, width) per tensor."""
        path = self.path
        if (self.ranks < 0).any() or (self.row_offsets < 0).any() or not torch.isfinite(self.scalings).all():
            raise AdapterError(f"{path}: manifest has negative ranks or offsets, or non-finite scalings")
        want_dtype = _ST_DTYPES[self.dtype]
        ranks, starts = self.ranks.long(), self.row_offsets
        tensors = {}
        for layer in range(self.model.num_hidden_layers):
            for p, proj in enumerate(PROJECTIONS):
                r, s = ranks[:, layer, p], starts[:, layer, p]
                used = r > 0
                if not used.any():
                    continue
                order = torch.argsort(s[used])
                lo, hi = s[used][order], (s + r)[used][order]
                if (lo[1:] < hi[:-1]).any():
                    raise AdapterError(f"{path}: manifest blocks of layer {layer} {proj} overlap")
                in_f, out_f = self.model.projection_shape(proj)
                for suffix, width in (("lora_a", in_f), ("lora_b_t", out_f)):
                    name = f"layers.{layer}.{proj}.{suffix}"
                    if name not in infos:
                        raise AdapterError(f"{path}: tensor {name!r} is missing")
                    dtype, shape, (begin, stop) = infos[name]
                    if dtype != want_dtype or len(shape) != 2 or shape[1] != width or shape[0] < int(hi[-1]) \
                            or stop - begin != shape[0] * width * self.dtype.itemsize:
                        raise AdapterError(f"{path}: tensor {name!r} is {dtype} {shape}; the manifest needs "
                                           f"{want_dtype} [≥{int(hi[-1])}, {width}]")
                    tensors[name] = (begin, width)
        return tensors

    def read(self, index: int, dtype: torch.dtype, pin: bool) -> LoraAdapter:
        """Read one adapter's blocks with exact positioned reads (a memory map would read ahead
        megabytes around each of its hundreds of small blocks: most of the file, cold)."""
        spec = self.specs[index]
        item = self.dtype.itemsize
        tensors = {}
        for (layer, proj), m in spec.modules.items():
            HOST_PRIORITY.checkpoint()
            start = self._offsets[index][layer][PROJECTIONS.index(proj)]
            blocks = []
            for suffix in ("lora_a", "lora_b_t"):
                begin, width = self._tensors[f"layers.{layer}.{proj}.{suffix}"]
                nbytes = m.rank * width * item
                raw = os.pread(self._fd, nbytes, self._data_start + begin + start * width * item)
                if len(raw) != nbytes:
                    raise AdapterError(f"{self.path}: truncated (adapter {spec.name!r}, layer {layer} {proj})")
                blocks.append(torch.frombuffer(bytearray(raw), dtype=self.dtype).view(m.rank, width))
            tensors[(layer, proj)] = (blocks[0], blocks[1].T)
        adapter = pack_host_adapter(spec, tensors, dtype, pin)
        check_finite(adapter, f"{self.path}: adapter {spec.name!r}")
        return adapter

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


def _header_for(name: str, info: tuple) -> bytes:
    """A one-tensor safetensors header, so safetensors itself decodes a manifest tensor we read."""
    dtype, shape, (begin, stop) = info
    blob = json.dumps({name: {"dtype": dtype, "shape": shape, "data_offsets": [0, stop - begin]}}).encode()
    return len(blob).to_bytes(8, "little") + blob
