import pytest
import torch

from lopd_core.models.loading import (
    ModelNotFoundError,
    count_parameters,
    load_causal_lm,
    resolve_model_path,
)


def test_tiny_model_has_the_smollm2_tokenizer_and_template(tiny_tokenizer, tiny_model):
    assert len(tiny_tokenizer) == 49152
    assert tiny_tokenizer.pad_token == "<|im_end|>"
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert count_parameters(tiny_model) < 5_000_000
    ids = tiny_tokenizer("hello world", return_tensors="pt").input_ids
    loss = tiny_model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_missing_local_path_says_how_to_fix(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found locally; pass a local path"):
        resolve_model_path(str(tmp_path / "nope"), tmp_path)


def test_unprepared_default_points_to_prepare_command(tmp_path):
    with pytest.raises(ModelNotFoundError, match="lopd models prepare-default"):
        resolve_model_path("smollm2-135m-instruct", tmp_path)


def test_folder_without_config_is_rejected(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path / "empty"), tmp_path)


def test_dtype_choice(tiny_model_path):
    model = load_causal_lm(tiny_model_path, dtype="bfloat16", device="cpu")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_cuda_request_without_cuda_is_explained(tiny_model_path):
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    with pytest.raises(ValueError, match="model.device"):
        load_causal_lm(tiny_model_path, device="cuda")


@pytest.mark.slow
def test_prepare_default_converts_and_reuses(prepared_default_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lopd_core.models.default import CHECK_PROMPT, prepare_default

    model = AutoModelForCausalLM.from_pretrained(prepared_default_dir)
    assert abs(count_parameters(model) - 134.5e6) < 0.1e6
    tok = AutoTokenizer.from_pretrained(prepared_default_dir)
    enc = tok.apply_chat_template(CHECK_PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    answers = {tok.decode(model.generate(**enc, max_new_tokens=12, do_sample=False)[0]) for _ in range(2)}
    assert len(answers) == 1 and "Paris" in answers.pop()
    again = prepare_default(prepared_default_dir.parent, log=lambda m: None)
    assert again.reused
