"""The baselines: transformers (+ PEFT) `generate` on the same requests, in static batches.

- hf-backbone: the model alone; batches of up to `max_batch` requests in arrival order.
- hf-peft: one PEFT model holding every adapter the requests use; batches in arrival order, each row
  with its own adapter through `generate(..., adapter_names=[...])` (PEFT's mixed-adapter batches).
- hf-peft-grouped: only consecutive requests with the same adapter share a batch (the Punica paper's
  baselines), the adapter switched with `set_adapter`.
A batch runs until its longest request is done (static batching); a request's tokens count up to its
own output length, and its first and last token times are those of the steps that made them.
"""
from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from .flags import HF_SYSTEMS  # noqa: F401
from .results import RunResult, check_complete
from .workload import Workload
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load_hf_model(model: str, *, layers: int | None, dtype: torch.dtype, device: str):
    """transformers' model of a folder, or of a dummy:<preset> shape with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model.startswith("dummy:"):
        from ..models.presets import PRESETS
        fields = dict(PRESETS[model.removeprefix("dummy:")])
        if layers is not None:
            fields["num_hidden_layers"] = layers
        config = AutoConfig.for_model(**fields)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                hf = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
        finally:
            torch.set_default_dtype(previous)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=dtype).to(device)
    return hf.eval()


def add_adapters(hf, count: int, rank: int, seed: int = 0):
    """A PEFT model with `count` random adapters a0, a1, … of `rank` on all seven projections."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0,
                        init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(hf, config, adapter_name="a0")
    for i in range(1, count):
        peft_model.add_adapter(f"a{i}", config)
    return peft_model.eval()


def batches(workload: Workload, max_batch: int, grouped: bool) -> list[list[int]]:
    """Request indices per batch, in arrival order; `grouped`: one adapter per batch, consecutive only."""
    out: list[list[int]] = []
    for r in workload.requests:
        if out and len(out[-1]) < max_batch and (
                not grouped or workload.requests[out[-1][0]].adapter == r.adapter):
            out[-1].append(r.index)
        else:
            out.append([r.index])
    return out


class _StepClock:
    """A stopping criterion that never stops: it notes when each generated token is ready."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        torch.cuda.synchronize() if input_ids.is_cuda else None
        self.times.append(time.perf_counter() - self.start)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def run_hf(model, system: str, workload: Workload, prompts: list[list[int]], *, max_batch: int,
           progress: bool = True) -> RunResult:
    """Run `system` (one of HF_SYSTEMS) on every request of `workload`; `model` is a PEFT model for hf-peft*."""
    from transformers import StoppingCriteriaList

    if system not in HF_SYSTEMS:
        raise ValueError(f"system must be one of {HF_SYSTEMS}, got {system!r}")
    device = next(model.parameters()).device
    n = len(workload.requests)
    first, last, got = [0.0] * n, [0.0] * n, [0] * n
    plan = batches(workload, max_batch, grouped=system == "hf-peft-grouped")
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with tqdm(total=workload.output_tokens, desc=system, unit="tok", disable=not progress, mininterval=2) as bar:
        for batch in plan:
            reqs = [workload.requests[i] for i in batch]
            width = max(r.prompt_len for r in reqs)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, i in enumerate(batch):    # left padding, as batched generation needs
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            steps = max(r.output_len for r in reqs)
            kwargs = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0,
                          eos_token_id=None, use_cache=True)
            if system == "hf-peft":
                kwargs["adapter_names"] = [f"a{r.adapter}" for r in reqs]
            elif system == "hf-peft-grouped":
                model.set_adapter(f"a{reqs[0].adapter}")
            clock = _StepClock(start)
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 stopping_criteria=StoppingCriteriaList([clock]), **kwargs)
            if out.shape[1] - width != steps or len(clock.times) != steps:
                raise RuntimeError(f"{system}: generate made {out.shape[1] - width} tokens for {steps} steps")
            for r in reqs:
                first[r.index] = clock.times[0]
                last[r.index] = clock.times[r.output_len - 1]
                got[r.index] = r.output_len
            bar.update(sum(r.output_len for r in reqs))
    seconds = time.perf_counter() - start
    result = RunResult(system, workload.popularity, max_batch, n, workload.prompt_tokens, sum(got), seconds,
                       first, last, got, extra=dict(batches=len(plan)))
    check_complete(result, [r.output_len for r in workload.requests])
    return result
