"""Checkpoint folders made on the spot, as Hugging Face writes them: random Qwen3 weights with
`save_pretrained`, and a small byte-level BPE tokenizer with a Qwen3-style chat template built with the
`tokenizers` library. Nothing is downloaded; `./check.sh run`'s self-tests and its GPU measurement use them.

    make_checkpoint(folder)                        # tiny: 2 layers, hidden 64, float32
    make_checkpoint(folder, shape="qwen3-0.6b", dtype=torch.bfloat16)   # Qwen3-0.6B's shapes, random
"""

from pathlib import Path

import torch

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINKING = ("<think>", "</think>")  # added tokens, not special: Qwen3 shows them in its text
# What the tokenizer learns its characters and merges from (a character it never saw is dropped)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Japan is Tokyo.",
    "A cache keeps the keys and values of every token, so a decode step computes one new token.",
    "Name three prime numbers: two, three and five. Seven and eleven are prime too.",
    "Hello! How can I help you today?\nI am a small model with random weights.\n\n",
]
# Qwen3's chat layout, written for the kit: a user turn, the assistant's opening, and with thinking off an
# empty think block (what Qwen3's own template adds for enable_thinking=False)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
SHAPES = {  # Qwen3Config arguments
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
}


def make_tokenizer(folder: Path, vocab_size: int = 320):
    """A byte-level BPE tokenizer with Qwen3's special tokens and a chat template, saved into `folder`
    (tokenizer.json, tokenizer_config.json); returns it as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    # the corpus's own characters only (no stray bytes): a random model's text then reads as words
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False)
    core.train_from_iterator(CORPUS, trainer)
    core.add_tokens(list(THINKING))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def make_checkpoint(folder: Path, shape: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0,
                    init_std: float = 0.2):
    """A Qwen3 checkpoint with random weights and the tokenizer above in `folder`; returns the tokenizer.
    `init_std`: the weights' spread (HF's 0.02 makes a tiny model's logits nearly tied everywhere)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    dims = {"vocab_size": len(tokenizer), **SHAPES[shape]}
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(**dims, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         initializer_range=init_std, eos_token_id=[eos, tokenizer.pad_token_id],
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(str(folder))
    return tokenizer
