"""Where the shipped demo model, its adapters and their held-out text live.

The files are made by scripts/demo/collect_corpus.py and scripts/demo/train_demo.py and ship inside the
package (src/loraplex/demo/data): a ≈10 M-parameter Llama with a byte-level BPE tokenizer, and one LoRA
adapter per kind of text it was fine-tuned on.
"""
from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
ADAPTER_KINDS = ("python", "docs", "fortune", "json")
# a prompt per pane of `loraplex demo` that lets each adapter show what it learned
PROMPTS: dict[str | None, str] = {
    None: "The ",
    "python": "def ",
    "docs": "The ",
    "fortune": "A ",
    "json": "{",
}


class DemoModelMissing(FileNotFoundError):
    pass


def demo_model_dir() -> Path:
    """The demo base model's folder (config, safetensors weights, tokenizer files)."""
    folder = DATA_DIR / "model"
    if not (folder / "config.json").is_file():
        raise DemoModelMissing(f"the demo model is missing from {folder}: this installation of loraplex lacks its "
                               f"data files; reinstall it, or remake them with scripts/demo/train_demo.py")
    return folder


def demo_adapters() -> dict[str, Path]:
    """Name → PEFT adapter folder of each shipped adapter."""
    folders = {kind: DATA_DIR / "adapters" / kind for kind in ADAPTER_KINDS}
    missing = [str(f) for f in folders.values() if not (f / "adapter_config.json").is_file()]
    if missing:
        raise DemoModelMissing(f"demo adapter folders are missing: {', '.join(missing)}")
    return folders


def demo_prompts() -> dict[str | None, str]:
    """Adapter name (None: the base model) → a prompt that shows it off."""
    return dict(PROMPTS)


def heldout_path(kind: str) -> Path:
    """JSONL of {"text": …} documents of `kind` that neither the base nor any adapter was trained on."""
    if kind not in ADAPTER_KINDS:
        raise ValueError(f"kind must be one of {ADAPTER_KINDS}, got {kind!r}")
    return DATA_DIR / "heldout" / f"{kind}.jsonl"
