"""A small Llama with random weights and a word-level tokenizer, saved as a local model
directory that vLLM (or transformers) loads like any checkpoint: no hub download.

    python -m polarkv_lib.tools.tiny_llama DIR [--layers 4 --hidden 256 ...]

Needs torch, transformers and tokenizers (the engine environments have them). The
weights are drawn from a fixed seed, so the same arguments give the same model. The
tokenizer maps "w0" .. "wN" (split on whitespace) to ids 0 .. N, so a prompt of N
distinct words is N tokens: engines see exactly the prompt lengths a test asks for.
A directory that already holds the same spec is reused.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

SPEC_FILE = "polarkv-tiny-llama.json"


@dataclass(frozen=True)
class TinyLlama:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 704
    vocab: int = 4096
    max_len: int = 8192
    dtype: str = "float32"
    # Larger than Llama's 0.02: random logits far apart keep greedy decoding away from
    # near-ties, so runs that must agree token for token are not at the mercy of the
    # last bit of a float.
    init_std: float = 0.2
    seed: int = 0


def word(i: int) -> str:
    """The text of token id `i`."""
    return f"w{i}"


def build(path: str, spec: TinyLlama = TinyLlama()) -> str:
    """Write the model to `path` (unless already there) and return `path`."""
    spec_path = os.path.join(path, SPEC_FILE)
    if os.path.exists(spec_path):
        with open(spec_path) as fh:
            if json.load(fh) == asdict(spec):
                return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_len,
        initializer_range=spec.init_std,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model: Any = LlamaForCausalLM(config).to(getattr(torch, spec.dtype)).eval()
    model.config.dtype = spec.dtype
    model.save_pretrained(path)
    vocab = {word(i): i for i in range(spec.vocab - 1)}
    vocab["<unk>"] = spec.vocab - 1
    tk: Any = importlib.import_module("tokenizers")  # a transformers dependency
    tok = tk.Tokenizer(tk.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tk.decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", model_max_length=spec.max_len
    )
    fast.save_pretrained(path)
    with open(spec_path, "w") as fh:
        json.dump(asdict(spec), fh)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    for name, value in asdict(TinyLlama()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    path = args.pop("path")
    print(build(path, TinyLlama(**args)))


if __name__ == "__main__":
    main()
