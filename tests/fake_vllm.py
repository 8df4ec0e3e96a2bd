"""A stand-in for ``vllm.LLM`` with the API surface VLLMEngine uses (tests only: vLLM needs a CUDA torch).

Its completions are 1-3 copies of a digit token chosen from the prompt's last token, then EOS, with made-up
log-probs; it records every call so that tests can check what was pushed, reset, slept and woken.
"""

from __future__ import annotations

import types

import torch

EOS = 2


class FakeLLM:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.weights: dict[str, torch.Tensor] = {}
        model = types.SimpleNamespace(load_weights=self._load_weights)
        worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(worker=worker)))

    def _load_weights(self, pairs) -> None:
        self.calls.append(("load_weights", tuple(name for name, _ in pairs)))
        self.weights.update({name: tensor.detach().clone() for name, tensor in pairs})

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags)))

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", len(prompts)))
        self.params = params
        outputs = []
        for prompt in prompts:
            completions = []
            for k in range(params.n):
                tokens = [4 + (prompt["prompt_token_ids"][-1] + k) % 10] * (1 + k % 3) + [EOS]
                logprobs = [{t: types.SimpleNamespace(logprob=-0.1 * (j + 1) - k)} for j, t in enumerate(tokens)]
                completions.append(types.SimpleNamespace(token_ids=tokens, logprobs=logprobs))
            outputs.append(types.SimpleNamespace(outputs=completions))
        return outputs


def fake_sampling_params(**kwargs) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kwargs)
