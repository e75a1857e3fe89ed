"""The ``hf`` rollout engine: batched ``transformers`` generate on the live student model (CPU default).

What it does: left-pads a batch of token-id prompts, runs ``model.generate`` with the KV cache, stops each
sequence on the end-of-turn ids, and records for every generated token its log-prob under the *processed*
sampling distribution — the one the token was actually drawn from: logits / temperature, then top-k, then
top-p, renormalised (``generate``'s ``output_scores``). For greedy decoding (temperature 0) the sampling
distribution is a point mass, so the recorded value is the unscaled model log-prob (temperature 1, no
filtering), which is what a diagnostic wants. Training never uses these numbers; it recomputes its own.

What it is not: a server, or a copy of the weights. ``update_policy`` swaps the model reference, so a
rollout right after an optimizer step samples from the current student (a peft-wrapped model included)
without copying anything. The model is put in eval mode for generation and restored afterwards, and the
global torch RNG is left untouched when a seed is given (``torch.random.fork_rng``), so seeded rollouts do
not disturb the trainer's random stream.

Only ``params.stop_token_ids`` stop a sequence: the model's own EOS does not (an empty list means "run to
``max_new_tokens``"), matching the vllm engine. Sampling fields the model's own ``generation_config`` may set (repetition penalty, min-p, typical-p …)
are neutralised so that the processed distribution is exactly temperature/top-k/top-p.
"""

from __future__ import annotations

from typing import Any

import torch

from lopd_core.rollout.engines.base import Generation, SamplingParams


def _device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        return torch.device("cpu")


def _cut_at_stop(tokens: list[int], logprobs: list[float], stop_ids: set[int]) -> Generation:
    """Keep tokens up to and including the first stop id (``generate`` pads finished rows after it)."""
    for i, tok in enumerate(tokens):
        if tok in stop_ids:
            return Generation(token_ids=tokens[: i + 1], logprobs=logprobs[: i + 1], finish_reason="stop")
    return Generation(token_ids=tokens, logprobs=logprobs, finish_reason="length")


class HFEngine:
    """Batched ``transformers`` generation on an in-memory model (see the module docstring)."""

    name = "hf"

    def __init__(self, model, tokenizer, *, batch_size: int = 8, policy_version: str = "base"):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 (got {batch_size})")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; load it with lopd_core.models.loading.load_tokenizer")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.policy_version = policy_version

    # ---------------------------------------------------------------------------------------------
    def update_policy(self, model: Any, version: str) -> None:
        """Point the engine at the current student; the same object is used as is (no weight copy)."""
        if model is not None and model is not self.model:
            self.model = model
        self.policy_version = version

    # ---------------------------------------------------------------------------------------------
    def _generation_config(self, params: SamplingParams):
        from transformers import GenerationConfig

        sample = params.temperature > 0
        fields: dict[str, Any] = dict(
            max_new_tokens=params.max_new_tokens,
            do_sample=sample,
            # neutral values for everything the model's generation_config could otherwise fill in
            repetition_penalty=1.0,
            typical_p=1.0,
            no_repeat_ngram_size=0,
            min_length=0,
            num_beams=1,
            num_return_sequences=1,
            eos_token_id=list(params.stop_token_ids),
            pad_token_id=self.tokenizer.pad_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_scores=True,
        )
        if sample:  # greedy applies no warpers, so these only matter when sampling
            fields.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        if sample and getattr(self.model.generation_config, "min_p", None) is not None:
            fields["min_p"] = 0.0
        return GenerationConfig(**fields)

    def _left_pad(self, prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            if prompt:
                ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
                mask[row, width - len(prompt):] = 1
        return ids.to(device), mask.to(device)

    def _run_chunk(self, model_inputs: dict[str, torch.Tensor], prompt_width: int, config,
                   stop_ids: set[int]) -> list[Generation]:
        out = self.model.generate(**model_inputs, generation_config=config)
        # with input_ids the returned sequences start with the (padded) prompt; with inputs_embeds they do not
        new_tokens = out.sequences[:, prompt_width:]
        # log-probs of the chosen tokens under the processed (temperature, top-k/p) distribution
        logprobs = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True).float().cpu()
        gens = []
        for row in range(new_tokens.shape[0]):
            gens.append(_cut_at_stop(new_tokens[row].tolist(), logprobs[row].tolist(), stop_ids))
        return gens

    def _chunks(self, lengths: list[int]) -> list[list[int]]:
        """Index chunks of at most batch_size; sorted by length when there is more than one chunk (less padding)."""
        order = list(range(len(lengths)))
        if len(order) > self.batch_size:
            order.sort(key=lambda i: -lengths[i])
        return [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]

    def _generate(self, n: int, lengths: list[int], make_inputs, prompt_width_of, params: SamplingParams) -> list[Generation]:
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1 (got {params.max_new_tokens})")
        config = self._generation_config(params)
        stop_ids = set(params.stop_token_ids)
        results: list[Generation | None] = [None] * n
        was_training = self.model.training
        self.model.eval()
        device = _device_of(self.model)
        devices = [device.index or 0] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices, enabled=params.seed is not None), torch.inference_mode():
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                for chunk in self._chunks(lengths):
                    inputs = make_inputs(chunk, device)
                    for idx, gen in zip(chunk, self._run_chunk(inputs, prompt_width_of(inputs), config, stop_ids),
                                        strict=True):
                        results[idx] = gen
        finally:
            if was_training:
                self.model.train()
        return results  # type: ignore[return-value]

    # ---------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One generation per token-id prompt, batched ``batch_size`` at a time with left padding."""
        if not prompts:
            return []
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")

        def make_inputs(chunk, device):
            ids, mask = self._left_pad([prompts[i] for i in chunk], device)
            return {"input_ids": ids, "attention_mask": mask}

        return self._generate(len(prompts), [len(p) for p in prompts], make_inputs,
                              lambda inputs: inputs["input_ids"].shape[1], params)

    def generate_from_embeds(self, prompt_embeds: list[torch.Tensor], params: SamplingParams) -> list[Generation]:
        """Sample from prompts given as input embeddings ([T_i, d] each), e.g. a latent-conditioned teacher prompt.

        Rows are left-padded with zero vectors under a zero attention mask; the returned ids are only the
        new tokens. Gradients never flow (inference mode): this is for sampling, not for training.
        """
        if not prompt_embeds:
            return []
        hidden = self.model.get_input_embeddings().embedding_dim
        for i, e in enumerate(prompt_embeds):
            if e.dim() != 2 or e.shape[0] == 0 or e.shape[1] != hidden:
                raise ValueError(f"prompt_embeds[{i}] must have shape [T>0, {hidden}] (got {tuple(e.shape)})")

        def make_inputs(chunk, device):
            rows = [prompt_embeds[i] for i in chunk]
            width = max(r.shape[0] for r in rows)
            dtype = self.model.get_input_embeddings().weight.dtype
            embeds = torch.zeros((len(rows), width, hidden), dtype=dtype, device=device)
            mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
            for row, e in enumerate(rows):
                embeds[row, width - e.shape[0]:] = e.detach().to(device=device, dtype=dtype)
                mask[row, width - e.shape[0]:] = 1
            return {"inputs_embeds": embeds, "attention_mask": mask}

        return self._generate(len(prompt_embeds), [e.shape[0] for e in prompt_embeds], make_inputs,
                              lambda inputs: 0, params)
