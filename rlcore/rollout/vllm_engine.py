"""Generation with vLLM (``rollout.engine: vllm``): vLLM's offline engine in the worker's own process, token ids in,
token ids and log-probs out.

* **In process.** The engine core runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as TRL's
  colocate mode and verl's rollout workers run it: the worker reaches vLLM's model object, so weights move in memory.
* **Weights in memory.** vLLM builds its model from the policy's config with random weights (``load_format`` dummy;
  nothing is read from disk) and takes every weight through its own in-place reload path
  (``reload_weights(weights_iterator=...)``: its name mapping, q/k/v and gate/up fusion and CPU repacking). The
  engine also keeps the plain copy of the policy a rollout worker holds (``self.model``): a sync loads the trainer's
  tensors into it (only the adapters with LoRA, as for the other engines), and what vLLM takes is that copy's full
  weights with the adapter merged in (:func:`rlcore.engine.lora.merged_state`). The weight-sync check fingerprints
  the tensors handed over in that copy and compares vLLM's log-probs of the probe batch with the trainer's, so a
  sync vLLM did not take fails there.
* **Token in, token out.** Prompts are the token ids the other engines get (left padding removed), no tokenizer is
  loaded (``skip_tokenizer_init``), a response stops at EOS (``stop_token_ids``; vLLM keeps it in the output, as
  the other engines do). Log-probs are vLLM's ``processed_logprobs``: log softmax of the logits over the
  temperature, as the other engines return, except that with top-k/top-p vLLM's are those of the filtered
  distribution it sampled from. Each row is sampled with its own seed drawn from the call's generator, so a call
  is reproducible; vLLM's sampler draws other numbers than rlcore's (the same seed samples other tokens than the
  ``hf`` engine; greedy decoding gives the same).
* **Sized by params.** KV cache: ``rollout.kv_cache_gib``; rows scheduled at once: ``rollout.micro_batch_size``;
  ``rollout.compile``: vLLM's compiled path instead of eager mode; threads: the worker's own torch threads (its
  CPUs, ``resources``/``rollout.cpus_per_worker``), vLLM's thread binding off (``VLLM_CPU_OMP_THREADS_BIND=nobind``).

Multi-turn agent rollouts are not supported (config validation refuses ``rollout.agent.loop: tool`` with this
engine): the agent loop samples every token from full logits (:mod:`rlcore.rollout.turns`), which vLLM does not
hand out. vLLM's CPU attention runs head dims 32, 64, 80, ... (not the built-in tiny model's 16:
``model.tiny.num_heads 2`` gives 32); config validation refuses others on a CPU.
"""

from __future__ import annotations

import os
import random
import tempfile
from typing import Sequence

import numpy as np
import torch

from rlcore.engine import lora
from rlcore.engine.sequence import trim_left_padding
from rlcore.errors import VLLM_INSTALL_HINT
from rlcore.rollout.base import EngineSpec, SamplingParams, load_into

# vLLM reads these when it is imported; rlcore's worker owns its process (its threads, its logs)
_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def import_vllm():
    """The ``vllm`` package, imported with rlcore's settings; ImportError saying how to install it without it."""
    for key, value in _ENV.items():
        os.environ[key] = value
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up warnings are about features rlcore does not use
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"rollout.engine vllm: {VLLM_INSTALL_HINT} ({err})") from err
    return vllm


class VllmRolloutEngine:
    """Generates with a vLLM engine in this process over its own copy of the policy, refreshed by ``load_weights``."""

    def __init__(self, model: torch.nn.Module, spec: EngineSpec, *, eos_token_id: int, pad_token_id: int):
        vllm = import_vllm()
        self.model = model.eval()
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self._sampling = vllm.SamplingParams
        self._prompt = vllm.inputs.TokensPrompt
        config = lora.hf_model(model).config
        self.max_len = int(config.max_position_embeddings)
        weight = next(model.parameters())
        dtype = str(weight.dtype).removeprefix("torch.")
        # vLLM's CPU worker replaces torch.set_num_threads for the whole process, and seeds Python's, NumPy's and
        # torch's global generators: the worker's own (its threads, dropout, shuffles) are put back
        set_threads, states = torch.set_num_threads, (random.getstate(), np.random.get_state())
        try:
            with tempfile.TemporaryDirectory(prefix="rlcore-vllm-") as folder, \
                    torch.random.fork_rng(devices=[weight.device] if weight.device.type == "cuda" else []):
                config.save_pretrained(folder)  # the architecture only: weights come from memory below
                self.llm = vllm.LLM(model=folder, load_format="dummy", skip_tokenizer_init=True, dtype=dtype,
                                    enforce_eager=not spec.compile, max_model_len=self.max_len,
                                    max_num_seqs=spec.max_batch,
                                    kv_cache_memory_bytes=int(spec.kv_cache_gib * 2**30),
                                    logprobs_mode="processed_logprobs", enable_prefix_caching=True, seed=0)
        finally:
            torch.set_num_threads = set_threads
            random.setstate(states[0])
            np.random.set_state(states[1])
        self._runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        self._push()

    def _push(self) -> None:
        """Hand vLLM the copy's weights (adapter merged), then drop the prefix cache computed with the old ones."""
        self._runner.reload_weights(weights_iterator=iter(lora.merged_state(self.model).items()))
        self.llm.reset_prefix_cache()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        load_into(self.model, state_dict)
        self._push()

    def _rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
        return [ids[m.bool()].tolist() for ids, m in zip(input_ids.cpu(), attention_mask.cpu())]

    def log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, responses: torch.Tensor
                  ) -> torch.Tensor:
        """vLLM's log-probs of ``responses`` after each prompt (its prompt log-probs of prompt + response)."""
        width = responses.shape[1]
        prompts = [self._prompt(prompt_token_ids=p + r) for p, r in
                   zip(self._rows(input_ids, attention_mask), responses.cpu().tolist())]
        params = self._sampling(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out = torch.zeros(responses.shape, dtype=torch.float32)
        for i, result in enumerate(self.llm.generate(prompts, params, use_tqdm=False)):
            tokens, scores = result.prompt_token_ids[-width:], result.prompt_logprobs[-width:]
            out[i] = torch.tensor([s[t].logprob for t, s in zip(tokens, scores)])
        return out.to(responses.device)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None, *, seeds: Sequence[int] | None = None
                 ) -> dict[str, torch.Tensor]:
        """``seeds``: each row's own seed (vLLM's per-request ``seed``); by default drawn from ``generator``."""
        input_ids, attention_mask = trim_left_padding(input_ids, attention_mask)
        rows = self._rows(input_ids, attention_mask)
        if seeds is None:
            seeds = torch.randint(0, 2**31 - 1, (len(rows),), generator=generator, device=generator.device
                                  if generator is not None else "cpu").tolist()
        else:
            seeds = [int(s) for s in seeds]
        room = self.max_len - max(len(r) for r in rows)
        if room < params.max_new_tokens:
            raise ValueError(f"rollout engine vllm: prompts of {self.max_len - room} tokens leave room for {room} "
                             f"new tokens of {params.max_new_tokens} (the model's max_position_embeddings is "
                             f"{self.max_len})")
        stop = [self.eos_token_id] if self.eos_token_id >= 0 else []  # -1: no EOS (tests, benchmarks)
        sampling = [self._sampling(temperature=0.0 if params.greedy else params.temperature, top_p=params.top_p,
                                   top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_new_tokens,
                                   stop_token_ids=stop, ignore_eos=True, logprobs=0, detokenize=False,
                                   seed=seed)
                    for seed in seeds]
        results = self.llm.generate([self._prompt(prompt_token_ids=r) for r in rows], sampling, use_tqdm=False)
        batch, width = len(rows), params.max_new_tokens
        tokens = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros((batch, width), dtype=torch.float32)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, result in enumerate(results):
            out = result.outputs[0]
            ids = list(out.token_ids)[:width]
            tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, :len(ids)] = 1
            log_probs[i, :len(ids)] = torch.tensor([step[t].logprob for t, step in zip(ids, out.logprobs)])
        device = input_ids.device
        return {"responses": tokens.to(device), "response_mask": mask.to(device), "log_probs": log_probs.to(device)}

    def open_rows(self, *args, **kwargs):
        raise NotImplementedError("rollout engine vllm: multi-turn agent rollouts (rollout.agent.loop tool) need "
                                  "the hf or static engine")
