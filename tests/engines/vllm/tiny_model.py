#!/usr/bin/env python3
"""Build a tiny, fully offline Llama model directory for vLLM (weights are
never read: the server runs with --load-format dummy).

usage: <venv>/bin/python tiny_model.py OUT_DIR

Writes: config.json (LlamaForCausalLM, hidden 256, 4 heads x head_dim 64,
2 layers, vocab 1024), generation_config.json, tokenizer.json (byte-level BPE
trained here on a generated corpus), tokenizer_config.json (with
chat_template) and special_tokens_map.json.  Deterministic, no network.
head_dim must be one of vLLM CPU_ATTN's sizes (32, 64, 80, 96, 112, 128, ...);
16 is rejected at the first request.
"""
import json
import os
import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB = 1024
HIDDEN = 256
HEADS = 4
HEAD_DIM = 64
LAYERS = 2
MAX_POS = 512
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def corpus(n_lines=20000, seed=0):
    rng = random.Random(seed)
    words = (
        "the a an of to in is it that for on with as was at by be this from or "
        "socket backend agent kernel probe node packet request response stream "
        "token model server client latency queue engine health metric trace "
        "connect accept read write close bytes header chunk done error retry "
        "hello world test data value time count rate first last next every "
        "alpha beta gamma delta one two three four five six seven eight nine ten"
    ).split()
    for _ in range(n_lines):
        n = rng.randint(4, 16)
        line = " ".join(rng.choice(words) for _ in range(n))
        yield line.capitalize() + rng.choice([".", "?", "!", ",", ":"]) + " " + str(rng.randint(0, 9999))


def main(out):
    os.makedirs(out, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    assert tok.token_to_id("<s>") == BOS_ID and tok.token_to_id("</s>") == EOS_ID
    tok.save(os.path.join(out, "tokenizer.json"))
    vocab_size = tok.get_vocab_size()
    assert vocab_size <= VOCAB, vocab_size

    def dump(name, obj):
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")

    dump("tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POS,
        "chat_template": CHAT_TEMPLATE,
    })
    dump("special_tokens_map.json", {
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
        "additional_special_tokens": SPECIALS[3:],
    })
    dump("config.json", {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 4 * HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    })
    dump("generation_config.json", {
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
    })
    print(f"built {out}: tokenizer vocab {vocab_size}, model vocab {VOCAB}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny-llama"))
