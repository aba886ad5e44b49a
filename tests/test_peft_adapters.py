"""PEFT folders in the slot pool, with PEFT itself as the oracle: what `merge_and_unload()` adds to each
base weight is what the pool's slot adds (`scaling * B @ A`), projection by projection, for Llama,
Mistral and Qwen2 (grouped-query attention: k/v narrower than q) under every way a config picks its
modules, ranks and scales; and a loaded slot drives `ops.add_lora` to the merged model's outputs."""
from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex import ops
from loraplex.adapters import AdapterPool, inspect_peft_adapter, read_peft_adapter
from loraplex.models import PROJECTIONS, ModelConfig, module_path

from adapter_fixtures import FAMILIES, make_adapter, make_base
from lora_cases import stable_seed

NUM_SLOTS, MAX_RANK, SLOT = 3, 32, 2  # a non-zero slot: slot indexing must not be off by one
SAFETENSORS, BIN = "adapter_model.safetensors", "adapter_model.bin"
# The oracle's own error: PEFT stores W + Δ in fp32, so (W + Δ) − W is off by up to half an ulp of
# max|W + Δ| (2^-24 relative) per entry, and PEFT forms Δ = B @ A in fp32 (~r·2^-24·|B||A|). The pool's
# delta is float64 math on the exact fp32 A and B. 1e-6 of (max|W| + max|Δ|) is ~16 ulps: loose enough
# for both, and still 1e-5 of the delta itself, far below any wrong scale, rank or transpose.
MERGE_RTOL = 1e-6
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


@dataclass
class Base:
    dir: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # module name → float64 weight [out, in]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """One tiny random base model per family (GQA: 4 heads, 2 kv heads), written once per module."""
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = make_base(root / family, family, seed=10 + i)
        state = load_file(folder / "model.safetensors")
        weights = {k[: -len(".weight")]: v.double() for k, v in state.items() if k.endswith(".weight")}
        out[family] = Base(folder, ModelConfig.from_pretrained(folder), weights)
    return out


# ---- edits applied to a saved folder ------------------------------------------------------------

_DELETE = object()


def set_config(**changes):
    """Rewrite fields of adapter_config.json (`_DELETE` removes one), as a hand-edited folder would."""
    def edit(folder: Path) -> None:
        path = folder / "adapter_config.json"
        cfg = json.loads(path.read_text())
        for key, value in changes.items():
            if value is _DELETE:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        path.write_text(json.dumps(cfg))
    edit.__name__ = "set_config(" + ",".join(changes) + ")"
    return edit


def to_bin(folder: Path) -> None:
    """Re-save the weights as adapter_model.bin (what `save_pretrained(safe_serialization=False)` writes)."""
    torch.save(load_file(folder / SAFETENSORS), folder / BIN)
    (folder / SAFETENSORS).unlink()


def name_infix(name: str):
    """Keys as PEFT's in-memory state dict has them: `...lora_A.<name>.weight`."""
    def edit(folder: Path) -> None:
        state = load_file(folder / SAFETENSORS)
        renamed = {re.sub(r"\.lora_([AB])\.weight$", rf".lora_\1.{name}.weight", k): v for k, v in state.items()}
        assert renamed.keys() != state.keys()
        save_file(renamed, folder / SAFETENSORS)
    return edit


def cast_file(dtype: torch.dtype):
    def edit(folder: Path) -> None:
        state = load_file(folder / SAFETENSORS)
        save_file({k: v.to(dtype) for k, v in state.items()}, folder / SAFETENSORS)
    return edit


# ---- checks -------------------------------------------------------------------------------------

def new_pool(config: ModelConfig, dtype=torch.float32) -> AdapterPool:
    return AdapterPool(config, NUM_SLOTS, MAX_RANK, dtype, "cpu")


def load(folder: Path, base: Base, dtype=torch.float32, pool: AdapterPool | None = None, slot: int = SLOT):
    spec = inspect_peft_adapter(folder, base.config, max_rank=MAX_RANK)
    pool = pool or new_pool(base.config, dtype)
    pool.write(slot, read_peft_adapter(spec, dtype))
    return spec, pool


def merge_atol(base: Base, name: str, delta: torch.Tensor) -> float:
    return MERGE_RTOL * (base.weights[name].abs().max().item() + delta.abs().max().item())


def check_slot(pool: AdapterPool, slot: int, base: Base, deltas: dict[str, torch.Tensor], bound=None) -> None:
    """The slot holds exactly PEFT's deltas: equal where PEFT changed a weight, rank 0 everywhere else."""
    config = base.config
    paths = {module_path(layer, proj) for layer in range(config.num_hidden_layers) for proj in PROJECTIONS}
    assert set(deltas) <= paths, f"PEFT changed modules outside the decoder projections: {set(deltas) - paths}"
    assert int((pool.ranks[:, :, slot] > 0).sum()) == len(deltas)
    for layer in range(config.num_hidden_layers):
        for p, proj in enumerate(PROJECTIONS):
            name = module_path(layer, proj)
            if name not in deltas:
                assert int(pool.ranks[layer, p, slot]) == 0, f"{name}: PEFT leaves it alone but the slot has a rank"
                continue
            want, got = deltas[name], pool.delta(slot, layer, proj)
            assert got.shape == want.shape, name
            atol = merge_atol(base, name, want)
            assert want.abs().max() > 1e3 * atol, f"{name}: delta too small to test"  # never a vacuous pass
            allowed = atol if bound is None else bound(layer, proj) + atol
            err = (got - want).abs()
            assert (err <= allowed).all(), f"{name}: max error {err.max():.3e} (max delta {want.abs().max():.3e})"


def check_file_deltas(folder: Path, base: Base, deltas: dict[str, torch.Tensor]) -> None:
    """Sanity of the oracle itself: scaling * B @ A from the file (fp64) is PEFT's merged delta."""
    spec = inspect_peft_adapter(folder, base.config)
    adapter = read_peft_adapter(spec, torch.float32)
    for (layer, proj), m in adapter.modules.items():
        name = module_path(layer, proj)
        ours = m.scaling * (m.b.double() @ m.a.double())
        assert (ours - deltas[name]).abs().max() <= merge_atol(base, name, deltas[name]), name


# ---- the variants: (id, families, LoraConfig kwargs, edits to the saved folder) -----------------

QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
PATTERNS = dict(rank_pattern={"k_proj": 4, "down_proj": 3, "model.layers.1.mlp.up_proj": 2},
                alpha_pattern={"down_proj": 3, "v_proj": 32})
_VARIANTS = [
    ("short-names", FAMILIES, dict(target_modules=QKVO), ()),
    ("short-names-mlp", ("mistral",), dict(target_modules=["k_proj", *MLP], r=5, lora_alpha=7), ()),
    ("full-names", ("llama", "qwen2"),
     dict(target_modules=["model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.q_proj",
                          "model.layers.1.mlp.down_proj"]), ()),
    ("regex", ("llama", "qwen2"), dict(target_modules=r".*\.(q_proj|v_proj)"), ()),
    ("regex-one-layer", ("mistral",), dict(target_modules=r"model\.layers\.1\.(self_attn\.k|mlp\.(gate|up))_proj"), ()),
    ("all-linear", FAMILIES, dict(target_modules="all-linear"), ()),
    # PEFT saves all-linear expanded to module names; a hand-written config keeps the shorthand.
    ("all-linear-literal", ("llama", "qwen2"), dict(target_modules="all-linear"),
     (set_config(target_modules="all-linear"),)),
    ("default-targets", FAMILIES, dict(target_modules=None), ()),
    ("default-targets-unsaved", ("llama", "mistral"), dict(target_modules=None),
     (set_config(target_modules=_DELETE),)),
    ("default-targets-null", ("qwen2",), dict(target_modules=None), (set_config(target_modules=None),)),
    ("rslora", ("llama", "qwen2"), dict(target_modules=QKVO + MLP, r=16, lora_alpha=12, use_rslora=True), ()),
    ("rank-alpha-patterns", FAMILIES, dict(target_modules="all-linear", **PATTERNS), ()),
    ("rank-alpha-patterns-rslora", ("mistral",), dict(target_modules="all-linear", use_rslora=True, **PATTERNS), ()),
    ("layers-int", ("llama",), dict(target_modules=["q_proj", "k_proj", "down_proj"], layers_to_transform=1), ()),
    ("layers-list", ("qwen2",), dict(target_modules=QKVO, layers_to_transform=[0]), ()),
    ("layers-int-pattern", ("mistral",), dict(target_modules=["v_proj", "up_proj"], layers_to_transform=0,
                                              layers_pattern="layers"), ()),
    ("layers-list-pattern", ("llama", "qwen2"), dict(target_modules=QKVO + MLP, layers_to_transform=[1],
                                                     layers_pattern="layers"), ()),
    ("exclude-list", ("mistral", "llama"), dict(target_modules="all-linear",
                                                exclude_modules=["o_proj", "model.layers.1.mlp.up_proj"]), ()),
    ("exclude-regex", ("qwen2", "llama"), dict(target_modules=QKVO + ["down_proj"],
                                               exclude_modules=r".*layers\.0\.(self_attn\.[kv]|mlp\.down)_proj"), ()),
    ("dropout", ("qwen2", "mistral"), dict(target_modules=QKVO, lora_dropout=0.3), ()),
    ("fan-in-fan-out", ("llama",), dict(target_modules=QKVO + ["gate_proj"], fan_in_fan_out=True), ()),
    # PEFT switches fan_in_fan_out off for nn.Linear when loading too: a config still saying true means the same.
    ("fan-in-fan-out-saved-true", ("llama", "qwen2"), dict(target_modules=QKVO, fan_in_fan_out=True),
     (set_config(fan_in_fan_out=True),)),
    ("causal-lm-task", ("qwen2",), dict(target_modules=QKVO, task_type="CAUSAL_LM"), ()),
    ("bin-file", FAMILIES, dict(target_modules=["q_proj", "v_proj", "down_proj"], r=6), (to_bin,)),
    ("name-infix", ("llama", "mistral"), dict(target_modules=QKVO), (name_infix("default"),)),
    ("name-infix-custom", ("qwen2",), dict(target_modules=QKVO + MLP, r=4), (name_infix("my_adapter"),)),
    ("name-infix-bin", ("mistral",), dict(target_modules=QKVO), (name_infix("default"), to_bin)),
]
VARIANTS = [pytest.param(family, kwargs, edits, id=f"{family}-{vid}")
            for vid, families, kwargs, edits in _VARIANTS for family in families]


@pytest.mark.parametrize("family, lora, edits", VARIANTS)
def test_slot_equals_peft_merge(bases, tmp_path, family, lora, edits):
    """Every projection PEFT's merge changes, the slot changes identically; every other one has rank 0."""
    base = bases[family]
    folder, deltas = make_adapter(base.dir, tmp_path / "adapter", seed=stable_seed(family, lora), merged=True, **lora)
    for edit in edits:
        edit(folder)
    spec, pool = load(folder, base)
    assert spec.warnings == []
    assert len(spec.modules) == len(deltas)
    check_slot(pool, SLOT, base, deltas)
    others = [s for s in range(NUM_SLOTS) if s != SLOT]
    assert int(pool.ranks[:, :, others].abs().sum()) == 0, "writing one slot touched another"
    for (layer, proj), m in spec.modules.items():
        assert int(pool.ranks[layer, PROJECTIONS.index(proj), SLOT]) == m.rank


def test_gqa_shapes_are_exercised(bases):
    """The fixtures really are GQA: k/v are narrower than q, so a k/v/q mix-up cannot pass unnoticed."""
    for base in bases.values():
        q_out, k_out = base.config.projection_shape("q_proj")[1], base.config.projection_shape("k_proj")[1]
        assert k_out < q_out
        assert base.weights[module_path(0, "k_proj")].shape == (k_out, base.config.hidden_size)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_non_default_adapter_name(bases, tmp_path, family):
    """An adapter trained under another name (PEFT saves it in a sub-folder, keys without the name) loads the same."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = bases[family]
    model = AutoModelForCausalLM.from_pretrained(base.dir)
    torch.manual_seed(stable_seed("named", family))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj", "up_proj"],
                                                      init_lora_weights=False), adapter_name="sql")
        peft_model.save_pretrained(tmp_path / "out")
    merged = peft_model.merge_and_unload().state_dict()
    deltas = {k[: -len(".weight")]: v.double() - base.weights[k[: -len(".weight")]]
              for k, v in merged.items() if k.endswith(".weight")}
    deltas = {k: v for k, v in deltas.items() if v.abs().max() > 0}
    folder = tmp_path / "out" / "sql"
    keys = list(load_file(folder / SAFETENSORS))
    assert not any(".sql." in k for k in keys)  # PEFT drops the name from the saved keys
    spec, pool = load(folder, base)
    assert spec.name == "sql"
    check_slot(pool, SLOT, base, deltas)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("file_dtype, pool_dtype", [
    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
    (torch.float16, torch.float16), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
], ids=lambda d: str(d).replace("torch.", ""))
def test_half_precision(bases, tmp_path, family, file_dtype, pool_dtype):
    """Weights stored in bf16/fp16, or served in them, match PEFT's fp32 merge within the rounding of A and B.

    Rounding A and B to a format of unit roundoff u moves each entry of scaling * B @ A by at most
    (2u + u²) · scaling · (|B| @ |A|): that elementwise bound (plus the merge's own error) is the tolerance.
    """
    base = bases[family]
    folder, deltas = make_adapter(base.dir, tmp_path / "adapter", seed=stable_seed(family, str(file_dtype)),
                                  merged=True, target_modules="all-linear", rank_pattern={"v_proj": 4})
    exact = read_peft_adapter(inspect_peft_adapter(folder, base.config), torch.float32)
    cast_file(file_dtype)(folder)
    u = max(UNIT_ROUNDOFF[file_dtype], UNIT_ROUNDOFF[pool_dtype])

    def bound(layer, proj):
        m = exact.modules[(layer, proj)]
        return 2.01 * u * abs(m.scaling) * (m.b.double().abs() @ m.a.double().abs())

    spec, pool = load(folder, base, pool_dtype)
    assert pool.lora_a[0]["q_proj"].dtype == pool_dtype
    check_slot(pool, SLOT, base, deltas, bound=bound)
    if file_dtype == pool_dtype or pool_dtype == torch.float32:  # no rounding on the way in: exact values
        for (layer, proj), m in read_peft_adapter(spec, pool_dtype).modules.items():
            want = exact.modules[(layer, proj)].a.to(file_dtype).to(pool_dtype)
            assert torch.equal(m.a, want)


def test_base_model_name_mismatch_warns(bases, tmp_path):
    """An adapter trained on another base model name loads (shapes fit) with a warning naming both models."""
    base = bases["mistral"]
    folder, deltas = make_adapter(base.dir, tmp_path / "adapter", seed=5, merged=True, target_modules=QKVO)
    assert inspect_peft_adapter(folder, base.config).warnings == []  # PEFT saved our own base path
    set_config(base_model_name_or_path="someone/Other-Model-7B")(folder)
    spec, pool = load(folder, base)
    assert len(spec.warnings) == 1
    assert "someone/Other-Model-7B" in spec.warnings[0] and str(base.dir) in spec.warnings[0]
    check_slot(pool, SLOT, base, deltas)


def test_base_model_same_name_elsewhere_is_quiet(bases, tmp_path):
    """The same model name under another path (a hub id vs a local copy) is not a mismatch."""
    base = bases["llama"]
    folder = make_adapter(base.dir, tmp_path / "adapter", seed=6)
    set_config(base_model_name_or_path=f"org/{base.dir.name}")(folder)
    assert inspect_peft_adapter(folder, base.config).warnings == []


@pytest.mark.parametrize("family", FAMILIES)
def test_add_lora_with_slot_gives_merged_outputs(bases, tmp_path, family):
    """x @ W_base.T plus add_lora over a loaded slot is x @ W_merged.T; rows with no adapter, or with an
    empty slot (rank 0, weights NaN), keep exactly x @ W_base.T."""
    base = bases[family]
    folder, deltas = make_adapter(base.dir, tmp_path / "adapter", seed=stable_seed("e2e", family), merged=True,
                                  target_modules="all-linear", rank_pattern={"k_proj": 4, "up_proj": 16},
                                  alpha_pattern={"o_proj": 5}, use_rslora=family == "qwen2")
    _, pool = load(folder, base)
    for layer in range(pool.model.num_hidden_layers):  # slot 0 never written: whatever is there must not be read
        for proj in PROJECTIONS:
            pool.lora_a[layer][proj][0].fill_(float("nan"))
            pool.lora_b[layer][proj][0].fill_(float("nan"))
    gen = torch.Generator().manual_seed(stable_seed("x", family))
    lens, slots = [5, 3, 4], [SLOT, -1, 0]
    batch = ops.LoraBatch.from_lengths(lens, slots, "cpu")
    for layer in range(base.config.num_hidden_layers):
        for proj in PROJECTIONS:
            name = module_path(layer, proj)
            w = base.weights[name]
            x = torch.randn(sum(lens), w.shape[1], generator=gen)
            y0 = x @ w.float().T
            stack = pool.stack(layer, proj)
            y = ops.add_lora(y0.clone(), x, stack.lora_a, stack.lora_b, batch, stack.ranks, stack.scalings,
                             backend="reference")
            merged = x[:5].double() @ (w + deltas[name]).T
            err = (y[:5].double() - merged).abs().max() / merged.abs().max()
            assert err < 1e-5, f"{name}: rel err {err:.2e}"
            assert torch.equal(y[5:], y0[5:]), f"{name}: rows without an adapter changed"


def test_two_slots_do_not_interfere(bases, tmp_path):
    """Two adapters in two slots of one pool each hold their own deltas; writing the second leaves the first."""
    base = bases["llama"]
    f1, d1 = make_adapter(base.dir, tmp_path / "a1", seed=21, merged=True, target_modules="all-linear", r=8)
    f2, d2 = make_adapter(base.dir, tmp_path / "a2", seed=22, merged=True, target_modules=["k_proj", "down_proj"],
                          r=12, lora_alpha=6)
    _, pool = load(f1, base, slot=0)
    load(f2, base, pool=pool, slot=2)
    check_slot(pool, 0, base, d1)
    check_slot(pool, 2, base, d2)
    assert int(pool.ranks[:, :, 1].abs().sum()) == 0


def test_rewriting_a_slot_leaves_no_leftover(bases, tmp_path):
    """A slot re-written with an adapter on fewer projections has rank 0 on the rest: nothing of the old tenant."""
    base = bases["qwen2"]
    f1, d1 = make_adapter(base.dir, tmp_path / "a1", seed=31, merged=True, target_modules="all-linear", r=16)
    f2, d2 = make_adapter(base.dir, tmp_path / "a2", seed=32, merged=True, target_modules=["v_proj"], r=4,
                          layers_to_transform=[1])
    f3, d3 = make_adapter(base.dir, tmp_path / "a3", seed=33, merged=True, target_modules=QKVO, r=2)
    _, pool = load(f1, base, slot=1)
    load(f3, base, pool=pool, slot=2)
    load(f2, base, pool=pool, slot=1)
    assert int((pool.ranks[:, :, 1] > 0).sum()) == 1
    check_slot(pool, 1, base, d2)
    check_slot(pool, 2, base, d3)
    load(f1, base, pool=pool, slot=1)  # and back: a smaller previous rank leaves nothing behind either
    check_slot(pool, 1, base, d1)


def test_oracle_is_scaling_b_at_a(bases, tmp_path):
    """The oracle agrees with the documented formula on the file's own tensors (guards the fixture, not src)."""
    base = bases["llama"]
    folder, deltas = make_adapter(base.dir, tmp_path / "adapter", seed=41, merged=True, target_modules="all-linear",
                                  use_rslora=True, r=9, lora_alpha=5, rank_pattern={"q_proj": 3})
    check_file_deltas(folder, base, deltas)
    spec = inspect_peft_adapter(folder, base.config)
    m = spec.modules[(0, "q_proj")]
    assert m.rank == 3 and m.scaling == pytest.approx(5 / math.sqrt(3))
