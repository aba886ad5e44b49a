"""Sampling: what each request asks for (`SamplingParams`, in `params`) and the batched `Sampler`
(in `sampler`, running the per-batch plan of `plan`)."""
from .params import (LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                     SEED_LIMIT, SamplingParams)
from .sampler import PendingSample, Sampler, SamplerOutput, TokenLogprobs

__all__ = ["LOGIT_BIAS_LIMIT", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_STOP_STRINGS", "MAX_STOP_TOKEN_IDS",
           "PendingSample", "SEED_LIMIT", "Sampler", "SamplerOutput", "SamplingParams", "TokenLogprobs"]
