"""The tokenizer and its chat template: ChatML (the reference recipe's, adding its two tokens where the vocabulary
lacks them), Zephyr, or the model's own."""

from __future__ import annotations

from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer and chat template


def build_tokenizer(model_args, trust_remote_code: bool = False, token: str | None = None) -> tuple[Any, list[int]]:
    """Returns the tokenizer and the ids of tokens it had to add (they are trained and saved with the adapter)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, trust_remote_code=trust_remote_code,
                                              token=token)
    added: list[str] = []
    if model_args.chat_template_format == "chatml":
        added = [t for t in ("<|im_start|>", "<|im_end|>") if t not in tokenizer.get_vocab()]
        if added:
            tokenizer.add_special_tokens({"additional_special_tokens": added})
        tokenizer.chat_template = CHATML_TEMPLATE
        tokenizer.eos_token = "<|im_end|>"  # generation must stop at the end of the assistant turn
    elif model_args.chat_template_format == "zephyr":
        if tokenizer.eos_token is None:
            raise ValueError("the zephyr template ends turns with the tokenizer's EOS token, and this tokenizer has "
                             "none; use --chat_template_format chatml.")
        tokenizer.chat_template = ZEPHYR_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padded positions are masked out of the loss by the collator
    return tokenizer, tokenizer.convert_tokens_to_ids(added)
