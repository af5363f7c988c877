"""The model folder `vllm serve` starts from on a host without network: a Qwen3-8B config and a synthetic tokenizer.

Dummy weights (`--load-format dummy`) need only `config.json`, but the OpenAI server needs a tokenizer for text and
chat. This one is written offline with the `tokenizers` library: a WordLevel model whose vocabulary covers every id
of the config's vocabulary (151936), so whatever ids the dummy model emits decode to text, and text made of those
words encodes back to the same ids:

- id i is the word `w<i>`, except Qwen's special tokens `<|endoftext|>` (151643, also the unknown token),
  `<|im_start|>` (151644) and `<|im_end|>` (151645, end of sequence), and the chat roles `user` (872),
  `assistant` (77091) and `system` (8948) at their ids in Qwen's own vocabulary;
- words are split on whitespace and punctuation (the `Whitespace` pre-tokenizer), decoded ids are joined by spaces;
- `tokenizer_config.json` names the generic fast tokenizer class and holds an im_start/im_end chat template that
  honours `add_generation_prompt`. No `generation_config.json`: vLLM then derives one from config.json.

Files are rewritten only when their content differs: the folder's path and contents are part of the configuration
that LOAD compares, so every run of a proof uses the same folder, written once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm-qwen3-8b-tp2"))

from driver import QWEN3_8B, VOCAB  # noqa: E402  (the LLM() recipe's driver: the same model config)

SPECIAL_TOKENS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
ROLE_WORDS = {872: "user", 77091: "assistant", 8948: "system"}
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",  # not the model type's (Qwen2's BPE) class
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
    "model_max_length": QWEN3_8B["max_position_embeddings"],
    "clean_up_tokenization_spaces": False,
    "chat_template": CHAT_TEMPLATE,
}


def word(token_id: int) -> str:
    """The text of one token id."""
    return SPECIAL_TOKENS.get(token_id) or ROLE_WORDS.get(token_id) or f"w{token_id}"


def words(ids: list[int]) -> str:
    """Text that the synthetic tokenizer encodes to exactly `ids` (ids of special tokens excepted)."""
    return " ".join(word(i) for i in ids)


def tokenizer_json() -> str:
    """tokenizer.json of the synthetic tokenizer (deterministic: the same text on every call)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {word(i): i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[151643]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS.values()])
    return tokenizer.to_str()


def write_model(folder: Path) -> Path:
    """Writes config.json, tokenizer.json and tokenizer_config.json into `folder` where they differ; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": json.dumps(QWEN3_8B, indent=1),
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": json.dumps(TOKENIZER_CONFIG, indent=1),
    }
    for name, text in files.items():
        path = folder / name
        if not path.is_file() or path.read_text() != text:
            tmp = path.with_name(f".{name}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="where to write the model folder (created if missing)")
    folder = write_model(Path(ap.parse_args().folder))
    print(f"model_folder: wrote Qwen3-8B config.json and a synthetic tokenizer to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
