"""The composer φ = (ψ, χ): retrieved experiences → J·K latent tokens in the LM's input-embedding space.

What this module is:

- the encoder input text of one (task, experience) pair: "Task to solve:\\n{task}\\n\\nReference past
  trajectory:\\n{the experience rendered with the chat template}", the experience fitted to
  ``lopd.experience_max_tokens`` tokens (observations shortened first, never cut inside an action), the
  header on top;
- the encoder ψ: the shared frozen backbone with the ``encoder`` LoRA adapter live (see
  :mod:`lopd_core.models.policy`); its output is the last-layer hidden states of the whole sequence;
- the compressor χ (:class:`Compressor`): a Perceiver-resampler / Q-Former. K learned queries
  (``randn / √d``), ``proj_in`` Linear(d, d), then ``depth`` iterations of ONE weight-shared block —
  ``latents += attention(q = LN(latents), k/v = LN(concat(x, latents)))`` and
  ``latents += FF(LN → Linear(d, 4d) → GELU → Linear(4d, d))`` — and the output
  ``LayerNorm(proj_out(latents))``, times a learnable gain initialised to the input-embedding RMS when
  ``lopd.latent_gain`` is on (a LayerNorm output has element RMS ≈ 1, SmolLM2-135M's embeddings ≈ 0.14);
- :func:`compose`: every pair is encoded and compressed on its own (pairs padded right into one encoder
  batch with an explicit attention mask; a pair that appears twice in a batch is computed once) and the
  J blocks of K latents of a rollout are concatenated by the caller.

What it is not: it does not retrieve, build teacher prompts or own the backbone (the compressor is the
only module it creates; the encoder LoRA lives on the shared base).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lopd_core.config import LOPDConfig
from lopd_core.models.policy import (
    ENCODER,
    ENCODER_PHI0,
    PolicySet,
    copy_adapter,
    embedding_rms,
    hidden_states,
    load_adapter,
    save_adapter,
)
from lopd_core.records.chat import encode, fit_turns, render_turns
from lopd_core.records.experience import Experience, own_turns


@dataclass(frozen=True)
class CompressorSpec:
    hidden_size: int
    n_latents: int
    depth: int
    n_heads: int
    latent_gain: float | None
    """Initial output gain (the embedding RMS), or None for no gain."""

    def to_dict(self) -> dict:
        return dict(hidden_size=self.hidden_size, n_latents=self.n_latents, depth=self.depth, n_heads=self.n_heads,
                    latent_gain=self.latent_gain)


class ResamplerBlock(nn.Module):
    """One cross-attention + feed-forward block; the compressor applies the same instance ``depth`` times."""

    def __init__(self, hidden_size: int, n_heads: int):
        super().__init__()
        if hidden_size % n_heads:
            raise ValueError(f"compressor heads ({n_heads}) must divide the hidden size ({hidden_size}); "
                             "set distill.lopd.compressor_heads to a divisor or 0 for the backbone's head count")
        self.n_heads = n_heads
        self.norm_queries = nn.LayerNorm(hidden_size)
        self.norm_keys_values = nn.LayerNorm(hidden_size)
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.ff = nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(),
                                nn.Linear(4 * hidden_size, hidden_size))

    def _heads(self, x: Tensor) -> Tensor:
        n, t, d = x.shape
        return x.view(n, t, self.n_heads, d // self.n_heads).transpose(1, 2)

    def forward(self, latents: Tensor, context: Tensor, context_mask: Tensor) -> Tensor:
        """``latents`` [N, K, d], ``context`` [N, T, d], ``context_mask`` [N, T] (1 = real token)."""
        n, k, d = latents.shape
        keys_values = self.norm_keys_values(torch.cat([context, latents], dim=1))
        q = self._heads(self.q_proj(self.norm_queries(latents)))
        key = self._heads(self.k_proj(keys_values))
        value = self._heads(self.v_proj(keys_values))
        # the latents always attend to themselves, so no row of the mask is empty (no NaN from softmax)
        allowed = torch.cat([context_mask.bool(), torch.ones(n, k, dtype=torch.bool, device=latents.device)], dim=1)
        attended = F.scaled_dot_product_attention(q, key, value, attn_mask=allowed[:, None, None, :])
        latents = latents + self.o_proj(attended.transpose(1, 2).reshape(n, k, d))
        return latents + self.ff(latents)


class Compressor(nn.Module):
    """χ: hidden states of one experience ``[T, d]`` → K latents ``[K, d]`` in the LM's embedding space."""

    def __init__(self, spec: CompressorSpec):
        super().__init__()
        d = spec.hidden_size
        self.spec = spec
        self.queries = nn.Parameter(torch.randn(spec.n_latents, d) / math.sqrt(d))
        self.proj_in = nn.Linear(d, d)
        self.block = ResamplerBlock(d, spec.n_heads)
        self.proj_out = nn.Linear(d, d)
        self.norm_out = nn.LayerNorm(d)
        self.gain = nn.Parameter(torch.tensor(float(spec.latent_gain))) if spec.latent_gain is not None else None

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """``hidden`` [N, T, d] (right-padded), ``attention_mask`` [N, T] → latents [N, K, d] (float32)."""
        context = self.proj_in(hidden.float())
        latents = self.queries.unsqueeze(0).expand(hidden.shape[0], -1, -1)
        for _ in range(self.spec.depth):
            latents = self.block(latents, context, attention_mask)
        out = self.norm_out(self.proj_out(latents))
        return out * self.gain if self.gain is not None else out


def compressor_spec(lopd_cfg: LOPDConfig, backbone_config, *, embed_rms: float) -> CompressorSpec:
    heads = lopd_cfg.compressor_heads or backbone_config.num_attention_heads
    return CompressorSpec(hidden_size=backbone_config.hidden_size, n_latents=lopd_cfg.n_latents,
                          depth=lopd_cfg.compressor_depth, n_heads=heads,
                          latent_gain=embed_rms if lopd_cfg.latent_gain else None)


# --------------------------------------------------------------------------------------------------
# Encoder inputs
def experience_turns(tokenizer, experience: Experience, *, max_tokens: int) -> list[dict]:
    """An experience's own turns (:func:`lopd_core.records.experience.own_turns`) fitted to ``max_tokens``
    (:func:`lopd_core.records.chat.fit_turns`): what a teacher and the encoder are shown of it."""
    turns = own_turns(experience.messages, instruction=experience.instruction)
    if not turns:
        turns = [{"role": "user", "content": experience.text}]
    return fit_turns(tokenizer, turns, max_tokens=max_tokens)


def experience_text(tokenizer, experience: Experience, *, max_tokens: int) -> str:
    """An experience rendered with the chat template and no system turn, in at most ``max_tokens`` tokens:
    the task request, the agent's actions, the tool observations (shortened first when it does not fit)."""
    return render_turns(tokenizer, experience_turns(tokenizer, experience, max_tokens=max_tokens))


ENCODER_HEADER = "Task to solve:\n{task}\n\nReference past trajectory:\n"


def encoder_text(tokenizer, task_instruction: str, experience: Experience, *, max_tokens: int) -> str:
    """The encoder's input for one (task, experience) pair: the header naming the current task, then the
    experience in its own budget ``max_tokens`` — the same turns a text teacher is shown of it
    (:func:`experience_turns`). The header comes on top of the budget: taken out of it, a long request
    (a codegen task with its example) left the experience too little room for its answer, and the encoder
    saw the experience's request without the code that solved it."""
    return ENCODER_HEADER.format(task=task_instruction) + experience_text(tokenizer, experience, max_tokens=max_tokens)


def encoder_ids(tokenizer, task_instruction: str, experience: Experience, *, max_tokens: int) -> list[int]:
    """Token ids of :func:`encoder_text`: at most the header's tokens plus ``max_tokens``."""
    return encode(tokenizer, encoder_text(tokenizer, task_instruction, experience, max_tokens=max_tokens))


def pad_right(sequences: list[list[int]], *, pad_id: int, device) -> tuple[Tensor, Tensor]:
    """Right-padded ids ``[N, T]`` and the attention mask from the real lengths (never from ``ids != pad``)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, : len(seq)] = 1
    return ids.to(device), mask.to(device)


def pair_key(task_id: str, experience_id: str) -> str:
    """Key of a (task, experience) pair in the anchor cache."""
    return f"{task_id}\u241f{experience_id}"


@dataclass(frozen=True)
class ComposerPair:
    """One encoder input: the current task and one retrieved experience."""

    task_id: str
    task_instruction: str
    experience: Experience

    @property
    def key(self) -> str:
        return pair_key(self.task_id, self.experience.experience_id)


def compose(policies, compressor: Compressor, pairs: list[ComposerPair], *, adapter: str, max_tokens: int,
            micro_batch: int = 0) -> Tensor:
    """Latents ``[P, K, d]`` of every pair (encoder adapter ``adapter`` live), gradients as the caller's mode allows.

    Unique pairs are encoded once and their latents reused; the encoder batch is padded right with an
    explicit attention mask. ``micro_batch`` > 0 splits the encoder batch (less activation memory).
    """

    if not pairs:
        return torch.zeros(0, compressor.spec.n_latents, compressor.spec.hidden_size, device=policies.device)
    unique: dict[str, int] = {}
    for pair in pairs:
        unique.setdefault(pair.key, len(unique))
    first = {pair.key: pair for pair in reversed(pairs)}
    ordered = sorted(unique, key=unique.get)
    sequences = [encoder_ids(policies.tokenizer, first[k].task_instruction, first[k].experience, max_tokens=max_tokens)
                 for k in ordered]
    step = micro_batch if micro_batch > 0 else len(sequences)
    blocks = []
    with policies.adapter(adapter) as encoder:
        for start in range(0, len(sequences), step):
            ids, mask = pad_right(sequences[start:start + step], pad_id=policies.tokenizer.pad_token_id,
                                  device=policies.device)
            hidden = hidden_states(encoder, input_ids=ids, attention_mask=mask)
            blocks.append(compressor(hidden, mask))
    latents = torch.cat(blocks, dim=0)
    return latents[torch.tensor([unique[p.key] for p in pairs], device=latents.device)]


# --------------------------------------------------------------------------------------------------
# The composer's state: φ (encoder adapter on the shared base + χ), the frozen φ0 and its anchor cache, β
COMPOSER_MANIFEST = "lopd_composer.json"


@dataclass
class ComposerState:
    """Everything of the composer that is not the shared backbone; saved as one plain directory."""

    compressor: Compressor
    compressor_phi0: Compressor | None = None
    """χ of φ0 (end of the first cold start); None until a cold start has run."""
    anchor_cache: dict[str, Tensor] | None = None
    """Anchor latents c_φ0 per (task, experience) pair, ``[K, d]`` on the CPU; filled lazily with φ0."""
    beta: float = 0.0
    """The dual variable of the margin constraint (restored across cycles)."""
    info: dict | None = None
    """Provenance: base model, cold-start steps and loss, joint-training steps."""

    def __post_init__(self) -> None:
        self.anchor_cache = self.anchor_cache if self.anchor_cache is not None else {}
        self.info = self.info if self.info is not None else {}

    @property
    def has_phi0(self) -> bool:
        return self.compressor_phi0 is not None


def new_composer_state(policies: PolicySet, lopd_cfg: LOPDConfig, *, seed: int = 0) -> ComposerState:
    """A fresh χ (seeded) on the policies' device; ψ is the freshly initialised ``encoder`` adapter (B = 0)."""

    backbone_config = policies.base.get_base_model().config
    spec = compressor_spec(lopd_cfg, backbone_config, embed_rms=embedding_rms(policies.base))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        compressor = Compressor(spec).to(policies.device)
    return ComposerState(compressor=compressor, beta=lopd_cfg.beta_init)


def freeze_phi0(policies, state: ComposerState) -> None:
    """Fix φ0 := the current φ (after the first cold start): frozen copies of ψ and χ; the anchor cache restarts."""
    import copy


    lora = policies.base.peft_config[ENCODER]
    if ENCODER_PHI0 not in policies.adapter_names():
        policies.add_adapter(ENCODER_PHI0, rank=lora.r, alpha=lora.lora_alpha, targets=sorted(lora.target_modules),
                             trainable=False, copy_from=ENCODER)
    else:
        copy_adapter(policies, ENCODER, ENCODER_PHI0)
    state.compressor_phi0 = copy.deepcopy(state.compressor).requires_grad_(False)
    state.anchor_cache = {}


def anchor_latents(policies, state: ComposerState, pairs: list[ComposerPair], *, max_tokens: int) -> Tensor:
    """c_φ0 of every pair ``[P, K, d]``: cached, or computed once with φ0 (no grad) and cached."""

    if not state.has_phi0:
        raise RuntimeError("the composer has no cold-start φ0 yet, so there are no anchor latents; run the cold start "
                           "(`lopd distill --cold-start`) or set distill.lopd.anchor_weight=0")
    missing = list({p.key: p for p in pairs if p.key not in state.anchor_cache}.values())
    if missing:
        with torch.no_grad():
            fresh = compose(policies, state.compressor_phi0, missing, adapter=ENCODER_PHI0, max_tokens=max_tokens)
        for pair, latents in zip(missing, fresh, strict=True):
            state.anchor_cache[pair.key] = latents.detach().cpu()
    return torch.stack([state.anchor_cache[p.key] for p in pairs]).to(policies.device)


def save_composer(policies, state: ComposerState, directory) -> None:
    """Write the composer directory: encoder adapter, χ, φ0 (adapter + χ), anchor cache, β and a JSON manifest."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file


    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_adapter(policies, ENCODER, directory / "encoder_adapter")
    save_file({k: v.detach().contiguous().cpu() for k, v in state.compressor.state_dict().items()},
              str(directory / "compressor.safetensors"))
    if state.has_phi0:
        save_adapter(policies, ENCODER_PHI0, directory / "phi0" / "encoder_adapter")
        save_file({k: v.detach().contiguous().cpu() for k, v in state.compressor_phi0.state_dict().items()},
                  str(directory / "phi0" / "compressor.safetensors"))
        keys = sorted(state.anchor_cache)
        cache = {f"pair_{i:06d}": state.anchor_cache[k].contiguous() for i, k in enumerate(keys)}
        save_file(cache or {"empty": torch.zeros(0)}, str(directory / "phi0" / "anchor_cache.safetensors"))
        (directory / "phi0" / "anchor_keys.json").write_text(json.dumps(keys))
    manifest = {"kind": "composer", "base_model": policies.base_model, "compressor": state.compressor.spec.to_dict(),
                "beta": state.beta, "has_phi0": state.has_phi0, "anchor_pairs": len(state.anchor_cache),
                "info": state.info}
    (directory / COMPOSER_MANIFEST).write_text(json.dumps(manifest, indent=2))


def read_composer_manifest(directory) -> dict:
    import json
    from pathlib import Path

    path = Path(directory) / COMPOSER_MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not a composer artifact (no {COMPOSER_MANIFEST}); pass a directory "
                                "written by lopd_core.training (cold start or distill), or none to start a fresh composer")
    return json.loads(path.read_text())


def load_composer(policies: PolicySet, directory: Path, lopd_cfg: LOPDConfig) -> ComposerState:
    """Load a composer directory into the policies' encoder adapters and a new :class:`ComposerState`."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file


    directory = Path(directory)
    manifest = read_composer_manifest(directory)
    if manifest["base_model"] != policies.base_model:
        raise ValueError(f"composer at {directory} was trained on base model '{manifest['base_model']}', but "
                         f"model.base is '{policies.base_model}'; the composer's encoder backbone must be the lineage's base")
    spec = CompressorSpec(**manifest["compressor"])
    wanted = compressor_spec(lopd_cfg, policies.base.get_base_model().config, embed_rms=spec.latent_gain or 0.0)
    if (spec.n_latents, spec.depth, spec.n_heads) != (wanted.n_latents, wanted.depth, wanted.n_heads):
        raise ValueError(f"composer at {directory} has K={spec.n_latents}, depth={spec.depth}, heads={spec.n_heads} but the "
                         f"config asks for K={wanted.n_latents}, depth={wanted.depth}, heads={wanted.n_heads} "
                         "(distill.lopd.n_latents / compressor_depth / compressor_heads)")
    device = str(policies.device)
    compressor = Compressor(spec).to(policies.device)
    compressor.load_state_dict(load_file(str(directory / "compressor.safetensors"), device=device))
    load_adapter(policies, ENCODER, directory / "encoder_adapter")
    state = ComposerState(compressor=compressor, beta=float(manifest["beta"]), info=manifest.get("info") or {})
    if manifest.get("has_phi0"):
        freeze_phi0(policies, state)  # creates the φ0 adapter slot and χ0 module
        load_adapter(policies, ENCODER_PHI0, directory / "phi0" / "encoder_adapter")
        state.compressor_phi0.load_state_dict(load_file(str(directory / "phi0" / "compressor.safetensors"), device=device))
        keys = json.loads((directory / "phi0" / "anchor_keys.json").read_text())
        cache = load_file(str(directory / "phi0" / "anchor_cache.safetensors"))
        state.anchor_cache = {k: cache[f"pair_{i:06d}"] for i, k in enumerate(keys)}
    return state
