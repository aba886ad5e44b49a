"""`loraplex convert` and packed files: the same pool contents as the folders, and clear refusals."""
import json
import struct

import pytest
import torch
from adapter_fixtures import make_adapter, make_base, write_adapter

from loraplex.adapters import AdapterCache, AdapterError, PackedFile, convert
from loraplex.cli import main
from loraplex.models import ModelConfig
from loraplex.models.config import PROJECTIONS


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny GQA Llama and five PEFT adapters of mixed ranks, targets, rank patterns and rsLoRA."""
    root = tmp_path_factory.mktemp("packed")
    base = make_base(root / "base", "llama", seed=3)
    variants = [
        dict(r=8, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2}),
        dict(r=4, target_modules="all-linear", use_rslora=True),
        dict(r=16, lora_alpha=7, target_modules=["k_proj", "down_proj"], layers_to_transform=[1]),
        dict(r=1, target_modules=r".*\.(o_proj|up_proj)", alpha_pattern={"up_proj": 5}),
        dict(r=6, target_modules=["gate_proj"]),
    ]
    adapters = [(f"ad{i}", make_adapter(base, root / f"ad{i}", seed=10 + i, **kw)) for i, kw in enumerate(variants)]
    return root, base, ModelConfig.from_pretrained(base), adapters


def pool_contents(cache, name):
    slot = cache.acquire(name) if cache.wait_resident(name, 10) else None
    assert slot is not None, cache.error(name)
    out = {}
    for layer in range(cache.model.num_hidden_layers):
        for p, proj in enumerate(PROJECTIONS):
            r = int(cache.pool.ranks[layer, p, slot])
            out[(layer, proj)] = (r, float(cache.pool.scalings[layer, p, slot]),
                                  cache.pool.lora_a[layer][proj][slot, :r].clone(),
                                  cache.pool.lora_b[layer][proj][slot, :, :r].clone())
    cache.release(name)
    return out


@pytest.mark.parametrize("file_dtype,pool_dtype", [(None, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (None, torch.bfloat16)],
                         ids=["fp32-file-fp32-pool", "bf16-file-bf16-pool", "fp32-file-bf16-pool"])
def test_packed_file_fills_the_pool_exactly_as_the_folders(setup, file_dtype, pool_dtype, tmp_path):
    root, base, model, adapters = setup
    path = convert(model, adapters, tmp_path / "out", dtype=file_dtype, progress=False)
    kw = dict(max_gpu_adapters=2, max_lora_rank=16, max_cpu_adapters=1, dtype=pool_dtype, device="cpu")
    from_folders, from_packed = AdapterCache(model, **kw), AdapterCache(model, **kw)
    for name, folder in adapters:
        from_folders.register(name, folder)
    assert from_packed.register_packed(path) == [n for n, _ in adapters]
    for name, _ in adapters:
        want, got = pool_contents(from_folders, name), pool_contents(from_packed, name)
        assert any(v[0] for v in want.values())
        for key in want:
            assert got[key][:2] == want[key][:2], (name, key)
            assert torch.equal(got[key][2], want[key][2]) and torch.equal(got[key][3], want[key][3]), (name, key)
        assert from_packed.spec(name).modules == from_folders.spec(name).modules


def test_packed_file_is_standard_safetensors_with_a_manifest(setup, tmp_path):
    """Any safetensors reader opens it; the header is 8-byte aligned; the manifest says who is where."""
    from safetensors import safe_open
    root, base, model, adapters = setup
    path = convert(model, adapters, tmp_path / "out", dtype=torch.float16, progress=False)
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert header_len % 8 == 0
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert meta["format"] == "loraplex-packed-lora" and meta["dtype"] == "float16"
        assert [e["name"] for e in json.loads(meta["adapters"])] == [n for n, _ in adapters]
        ranks = f.get_tensor("manifest.ranks")
        assert ranks.shape == (5, model.num_hidden_layers, len(PROJECTIONS))
        # ad2 targets k_proj and down_proj of layer 1 only, rank 16
        assert ranks[2, 1, PROJECTIONS.index("k_proj")] == 16 and ranks[2, 0].sum() == 0
        rows = int(ranks[:, 0, PROJECTIONS.index("q_proj")].sum())
        assert f.get_tensor("layers.0.q_proj.lora_a").shape == (rows, model.hidden_size)
        assert f.get_tensor("layers.0.q_proj.lora_a").dtype == torch.float16


def test_convert_refuses_a_bad_adapter_and_leaves_no_file(setup, tmp_path):
    root, base, model, adapters = setup
    bad = write_adapter(tmp_path / "bad", model, rank=4)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="bad.*use_dora"):
        convert(model, adapters + [("bad", bad)], tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "adapters.safetensors").exists()
    with pytest.raises(AdapterError, match="more than once: ad0"):
        convert(model, adapters + [("ad0", bad)], tmp_path / "out", progress=False)


def test_packed_file_for_another_model_is_refused(setup, tmp_path):
    root, base, model, adapters = setup
    path = convert(model, adapters[:2], tmp_path / "out", progress=False)
    other = ModelConfig(**{**model.__dict__, "intermediate_size": model.intermediate_size * 2})
    with pytest.raises(AdapterError, match="intermediate_size=96.*intermediate_size=192"):
        PackedFile(path, other)


def test_damaged_or_foreign_files_are_refused(setup, tmp_path):
    from safetensors.torch import save_file
    root, base, model, adapters = setup
    path = convert(model, adapters[:2], tmp_path / "out", progress=False)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-64])
    with pytest.raises(AdapterError, match="cut.safetensors: unreadable"):
        PackedFile(tmp_path / "cut.safetensors", model)
    save_file({"x": torch.ones(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(AdapterError, match="not a loraplex packed adapter file"):
        PackedFile(tmp_path / "plain.safetensors", model)
    with pytest.raises(AdapterError, match="no such packed adapter file"):
        PackedFile(tmp_path / "missing.safetensors", model)


def test_register_packed_is_all_or_nothing(setup, tmp_path):
    root, base, model, adapters = setup
    path = convert(model, adapters, tmp_path / "out", progress=False)
    small = AdapterCache(model, max_gpu_adapters=1, max_lora_rank=8, max_cpu_adapters=0, device="cpu")
    with pytest.raises(AdapterError, match="'ad2' has rank 16, above the pool's max_lora_rank=8"):
        small.register_packed(path)
    assert small.names() == []
    cache = AdapterCache(model, max_gpu_adapters=1, max_lora_rank=16, max_cpu_adapters=0, device="cpu")
    cache.register("ad3", adapters[0][1])
    with pytest.raises(AdapterError, match="'ad3' is already registered"):
        cache.register_packed(path)
    assert cache.names() == ["ad3"]


def test_convert_command(setup, tmp_path, capsys):
    root, base, model, adapters = setup
    args = ["convert", "--base", str(base), "--out", str(tmp_path / "o"), "--quiet", "--dtype", "bfloat16",
            "--lora"] + [f"{n}={p}" for n, p in adapters[:3]]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "packed 3 adapters (bfloat16)" in out
    assert [s.name for s in PackedFile(tmp_path / "o", model).specs] == ["ad0", "ad1", "ad2"]
    # every subfolder of a parent folder, named after it
    assert main(["convert", "--base", str(base), "--out", str(tmp_path / "o2"), "--quiet",
                 "--lora-dir", str(root)]) == 0
    assert sorted(s.name for s in PackedFile(tmp_path / "o2", model).specs) == [n for n, _ in adapters]
    assert main(["convert", "--base", str(base), "--out", str(tmp_path / "o3"), "--lora",
                 f"x={tmp_path / 'nope'}"]) == 1
    assert "nope: not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", "--base", str(base), "--out", str(tmp_path / "o4"), "--lora", "no-equals-sign"])


def _variant(src, dst, edit_tensors=None, edit_meta=None):
    """A copy of a packed file with its manifest tensors or metadata edited (as damage would)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(src))
    with safe_open(str(src), "pt") as f:
        meta = dict(f.metadata())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_meta:
        edit_meta(meta)
    save_file(tensors, str(dst), metadata=meta)
    return dst


def _set(name, index, value):
    def edit(t):
        t[name] = t[name].clone()
        t[name][index] = value
    return edit


@pytest.mark.parametrize("edit_tensors,edit_meta,match", [
    (_set("manifest.row_offsets", (0, 0, 0), -2), None, "negative ranks or offsets"),
    (_set("manifest.row_offsets", (1, 0, 0), 0), None, "blocks of layer 0 q_proj overlap"),
    (lambda t: t.update({"manifest.ranks": t["manifest.ranks"].float()}), None, "'manifest.ranks' must be I32"),
    (None, lambda m: m.update(dtype="bfloat16"), "'layers.0.q_proj.lora_a' is F32 .* needs BF16"),
    (None, lambda m: m.update(adapters=json.dumps([{"name": "ad0"}, {"name": "ad0"}])),
     "names appear more than once: ad0"),
    (None, lambda m: m.update(adapters=json.dumps([{}, {}])), "damaged manifest metadata"),
    (None, lambda m: m.update(adapters=json.dumps("ab")), "damaged manifest metadata"),
    (None, lambda m: m.update(model=json.dumps([1])), "damaged manifest metadata"),
], ids=["negative-offset", "overlap", "float-ranks", "dtype-mismatch", "duplicate-names", "no-names",
        "adapters-not-list", "model-not-object"])
def test_damaged_manifest_is_refused(setup, tmp_path, edit_tensors, edit_meta, match):
    """A damaged manifest must not make a read return another adapter's (or no adapter's) rows."""
    root, base, model, adapters = setup
    path = convert(model, adapters[:2], tmp_path / "out", progress=False)
    with pytest.raises(AdapterError, match=match):
        PackedFile(_variant(path, tmp_path / "bad.safetensors", edit_tensors, edit_meta), model)


def test_replacing_the_file_on_disk_does_not_mix_adapters(setup, tmp_path):
    """Re-running convert into the same folder swaps the file; a registered one keeps reading its own."""
    root, base, model, adapters = setup
    (a, fa), (b, fb) = adapters[1], adapters[4]
    path = convert(model, [(a, fa), (b, fb)], tmp_path / "out", progress=False)
    packed = AdapterCache(model, max_gpu_adapters=2, max_lora_rank=16, max_cpu_adapters=0,
                          dtype=torch.float32, device="cpu")
    packed.register_packed(path)
    convert(model, [(b, fb), (a, fa)], tmp_path / "out", progress=False)
    folders = AdapterCache(model, max_gpu_adapters=2, max_lora_rank=16, max_cpu_adapters=0,
                           dtype=torch.float32, device="cpu")
    folders.register(a, fa)
    want, got = pool_contents(folders, a), pool_contents(packed, a)
    for key in want:
        assert got[key][:2] == want[key][:2] and torch.equal(got[key][2], want[key][2]), key


def test_packed_read_refuses_values_the_serving_dtype_cannot_hold(setup, tmp_path):
    root, base, model, adapters = setup
    big = write_adapter(tmp_path / "big", model, rank=2)
    from safetensors.torch import load_file, save_file
    weights = load_file(str(big / "adapter_model.safetensors"))
    key = sorted(weights)[0]
    weights[key][0, 0] = 1e6  # fine in float32, inf in float16
    save_file(weights, str(big / "adapter_model.safetensors"))
    packed = PackedFile(convert(model, [("big", big)], tmp_path / "out", progress=False), model)
    packed.read(0, torch.float32, False)
    with pytest.raises(AdapterError, match="adapter 'big': holds NaN or infinite values once cast to float16"):
        packed.read(0, torch.float16, False)


def test_convert_refuses_names_the_server_would_refuse(setup, tmp_path):
    root, base, model, adapters = setup
    with pytest.raises(AdapterError, match="adapter name 'my adapter' is not allowed"):
        convert(model, [("my adapter", adapters[0][1])], tmp_path / "out", progress=False)
