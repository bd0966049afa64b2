"""``tiny-vlm``: a small vision-language model built offline, for tests and CPU recipes.

No pretrained VLM can be downloaded on relax's machines, so the model is built from
transformers' own classes of the SmolVLM family (Idefics3): a 2-layer SigLIP-style vision
encoder on 64 x 64 images (8 x 8 patches), the pixel-shuffle connector (scale 2: 16
image tokens per image) and a 2-layer Llama text model (``tiny-llama``'s shape) with
random weights (seed :data:`VLM_SEED`, so bit-identical everywhere), and the real
SmolLM2 tokenizer with the four Idefics3 image tokens added (ids 49152-49155).

Its processor is transformers' ``Idefics3Processor`` (``Idefics3ImageProcessor`` with no
image splitting, longest edge 64): relax never builds image placeholder tokens itself.
The chat template is SmolLM2's, extended with content parts: an ``{"type": "image"}``
part renders as ``<image>``, which the processor expands into the image's
``<fake_token_around_image><global-img><image>x16<fake_token_around_image>`` tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

VLM_SEED = 4321
IMAGE_SIZE = 64
IMAGE_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]


def smollm2_template(placeholders: dict[str, str]) -> str:
    """SmolLM2-Instruct's chat template with content parts: a ``{"type": kind}`` part
    renders as ``placeholders[kind]`` (which the model's processor expands), a text part
    as its text, a part of another type as nothing."""
    parts = "".join(f"{{% {'if' if i == 0 else 'elif'} part['type'] == '{kind}' %}}{text}"
                    for i, (kind, text) in enumerate(placeholders.items()))
    return (
        "{% for message in messages %}"
        "{% if loop.first and messages[0]['role'] != 'system' %}<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "{% endif %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{parts}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}"
        "{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


CHAT_TEMPLATE = smollm2_template({"image": "<image>"})
"""SmolLM2-Instruct's template with image parts (see the module docstring)."""


def tiny_vlm_config(vocab_size: int, image_token_id: int):
    """``Idefics3Config`` of ``tiny-vlm`` (see the module docstring)."""
    from transformers import Idefics3Config

    from relax.trainer.model_store import TINY_CONFIG

    text = dict(model_type="llama", vocab_size=vocab_size, bos_token_id=1, eos_token_id=2,
                pad_token_id=2, **TINY_CONFIG)
    text["tie_word_embeddings"] = False  # Idefics3 keeps its own lm_head
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8)
    return Idefics3Config(text_config=text, vision_config=vision, image_token_id=image_token_id,
                          scale_factor=2, tie_word_embeddings=False, pad_token_id=2)


def tiny_vlm_dir() -> Path:
    """The ``tiny-vlm`` folder (model, tokenizer, processor), built into the model cache once."""
    from relax.trainer.model_store import cache_dir, publish_folder, smollm2_tokenizer_dir

    def build(tmp: Path) -> None:
        from transformers import (
            AutoTokenizer,
            Idefics3ForConditionalGeneration,
            Idefics3ImageProcessor,
            Idefics3Processor,
        )

        tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
        tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
        tok.chat_template = CHAT_TEMPLATE
        images = Idefics3ImageProcessor(size={"longest_edge": IMAGE_SIZE},
                                        max_image_size={"longest_edge": IMAGE_SIZE},
                                        do_image_splitting=False)
        seq = (IMAGE_SIZE // 8) ** 2 // 4  # patches per image / scale_factor^2
        proc = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=seq,
                                 chat_template=CHAT_TEMPLATE)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(VLM_SEED)
            model = Idefics3ForConditionalGeneration(
                tiny_vlm_config(len(tok), tok.convert_tokens_to_ids("<image>"))).float()
        model.generation_config.eos_token_id = 2
        model.generation_config.pad_token_id = 2
        model.save_pretrained(tmp, safe_serialization=True)
        proc.save_pretrained(tmp)

    return publish_folder(build, cache_dir() / "models" / "tiny-vlm")


def is_multimodal(folder: str | Path) -> bool:
    """Whether the model in ``folder`` takes images or audio (its config has a
    ``vision_config`` or ``audio_config``)."""
    import json

    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return False
    data = json.loads(cfg.read_text())
    return "vision_config" in data or "audio_config" in data


__all__ = ["CHAT_TEMPLATE", "IMAGE_TOKENS", "is_multimodal", "smollm2_template", "tiny_vlm_config",
           "tiny_vlm_dir"]
