"""examples/finetune.py end to end: it trains a PEFT adapter on a tiny model on the CPU, the adapter
lowers the loss on its data, loraplex serves it exactly as transformers + PEFT run it, and bad
input is refused with the file and line named."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from server_fixtures import make_text_model

pytest.importorskip("peft")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune.py"
RESPONSE = " The quick brown fox."
WORDS = ["apple", "river", "stone", "cloud", "green", "seven", "table", "music", "light", "house", "paper", "night",
         "bread", "chair", "water", "smile", "plant", "train", "glass", "money", "story", "field", "voice", "sugar"]


def _load_example():
    spec = importlib.util.spec_from_file_location("finetune_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


finetune = _load_example()


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run(argv: list[str]) -> str:
    """main(argv) and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert finetune.main([str(a) for a in argv]) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny text model, its training data, and an adapter trained on it by the example."""
    root = tmp_path_factory.mktemp("finetune")
    base, _ = make_text_model(root)
    data = write_jsonl(root / "data.jsonl", [{"prompt": f"say {w}", "response": RESPONSE} for w in WORDS])
    out_dir = root / "ft"
    printed = run(["--base", base, "--data", data, "--out", out_dir, "--rank", "8", "--alpha", "16", "--lr", "1e-2",
                   "--batch-size", "8", "--max-steps", "30", "--seed", "0", "--device", "cpu"])
    return base, data, out_dir, printed


def hf_model(base: Path, adapter: Path | None):
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if adapter is not None:
            from peft import PeftModel
            model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


@torch.no_grad()
def response_loss(model, tokenizer, rows: list[dict]) -> float:
    """Mean cross-entropy of the response tokens (+ eos) after each prompt, one example at a time."""
    losses = []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        response = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
        predicted = logits[len(prompt) - 1:-1]
        losses.append(torch.nn.functional.cross_entropy(predicted, torch.tensor(response)))
    return float(torch.stack(losses).mean())


def test_the_adapter_is_a_peft_folder_that_lowers_the_loss(trained):
    from transformers import AutoTokenizer
    base, data, out_dir, printed = trained
    assert (out_dir / "adapter_model.safetensors").is_file()
    config = json.loads((out_dir / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["task_type"] == "CAUSAL_LM"
    assert set(config["target_modules"]) == set(finetune.ALL_PROJECTIONS)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(base)
    before = response_loss(hf_model(base, None), tokenizer, rows)
    after = response_loss(hf_model(base, out_dir), tokenizer, rows)
    assert after < 0.25 * before, f"the loss went from {before:.3f} to only {after:.3f}"
    assert "held-out loss before:" in printed and "held-out loss after:" in printed
    assert printed.rstrip().splitlines()[-1] == f"loraplex serve --model {base} --lora ft={out_dir}"


def test_loraplex_serves_the_adapter_as_peft_runs_it(trained):
    from transformers import AutoTokenizer

    from loraplex import LLM, SamplingParams
    base, _, out_dir, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(base)
    learned = tokenizer(RESPONSE, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompts, n = ["say apple", "say something new"], len(learned) + 2
    peft_model = hf_model(base, out_dir)
    expected = []
    with torch.no_grad():   # greedy decoding by hand: transformers + PEFT is the oracle
        for prompt in prompts:
            ids = tokenizer(prompt)["input_ids"]
            for _ in range(n):
                ids.append(int(peft_model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            expected.append(ids[-n:])
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with LLM(str(base), adapters={"ft": str(out_dir)}, device="cpu", dtype="float32", num_kv_blocks=64,
             block_size=8, max_num_seqs=4, max_num_batched_tokens=64) as llm:
        outs = llm.generate(prompts, params, adapter="ft", use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert outs[0].token_ids[:len(learned)] == learned, "the adapter should have learned its response and eos"


def test_chat_format_and_chosen_targets(trained, tmp_path):
    from transformers import AutoTokenizer
    base, data, _, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids, labels = finetune.encode(finetune.Example("say hi", " hi"), tokenizer, max_len=64, chat=True)
    prompt = tokenizer("<|user|>say hi\n<|assistant|>", add_special_tokens=False)["input_ids"]
    response = tokenizer(" hi", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids == prompt + response and labels == [-100] * len(prompt) + response
    out_dir = tmp_path / "chat"
    run(["--base", base, "--data", data, "--out", out_dir, "--rank", "4", "--alpha", "8", "--targets", "q_proj",
         "v_proj", "--chat", "--max-steps", "2", "--eval-fraction", "0", "--device", "cpu"])
    config = json.loads((out_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and set(config["target_modules"]) == {"q_proj", "v_proj"}


GOOD = {"prompt": "say hi", "response": " hi"}


@pytest.mark.parametrize("rows, expected", [
    ([GOOD, {"prompt": "say hi", "response": 7}], 'line 2: "response" must be a string'),
    ([GOOD, GOOD, "{not json"], "line 3: not valid JSON"),
    ([GOOD, {"prompt": ["a"], "completion": "b"}], 'line 2: "prompt" must be a string'),
    ([{"prompt": "x"}], 'line 1: "response" is missing'),
    ([GOOD, "[1, 2]"], "line 2: expected a JSON object"),
    ([], "no examples"),
], ids=["non-string-response", "not-json", "non-string-prompt", "missing-response", "not-an-object", "empty"])
def test_bad_data_names_the_file_and_line(trained, tmp_path, rows, expected):
    base = trained[0]
    data = write_jsonl(tmp_path / "bad.jsonl", rows) if rows else tmp_path / "bad.jsonl"
    if not rows:
        data.write_text("")
    with pytest.raises(SystemExit) as refused:
        finetune.main(["--base", str(base), "--data", str(data), "--out", str(tmp_path / "out")])
    message = str(refused.value.code)
    assert message.startswith("error: ") and f"{data}" in message and expected in message
    assert not (tmp_path / "out").exists()


def test_a_missing_base_folder_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", [GOOD])
    with pytest.raises(SystemExit) as refused:
        finetune.main(["--base", str(tmp_path / "nope"), "--data", str(data), "--out", str(tmp_path / "out")])
    assert str(tmp_path / "nope") in str(refused.value.code) and "no such folder" in str(refused.value.code)
