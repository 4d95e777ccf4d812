#!/usr/bin/env python3
"""Writes a small Llama with seeded random weights over the real Llama-3
vocabulary as a Hugging Face model folder, for tests that run a real vLLM on
loopback: config.json, model.safetensors and the tokenizer files.

The tokenizer is read from a tokenizer-only GGUF (llama.cpp's
models/ggml-vocab-llama-bpe.gguf: the Llama-3 BPE tokenizer, 128,256 tokens)
by transformers' GGUF loader, so vLLM tokenizes exactly as llama-server does
with scripts/tiny-model.py's model; the chat template is that script's
(Llama-3's format), so both engines see the same prompt for the same
messages.

Defaults: hidden 128, 2 layers, 4 query heads and 2 KV heads (grouped-query
attention as in Llama 3), FFN 512, tied embeddings: 16.7M parameters, about
37-55 ms for a cold 2,000-token prompt on one core. The weights are random
(torch's generator, fixed seed); the model says nothing meaningful and
exists to exercise vLLM's real HTTP API, tokenizer, scheduler, prefix cache
and metrics at CPU speed. Model files are build output: never commit them.

Needs (the vLLM venv has them): torch, transformers, gguf.

Usage: tiny-hf-model.py --vocab ggml-vocab-llama-bpe.gguf --out DIR
"""

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM


def chat_template() -> str:
    """scripts/tiny-model.py's Llama-3 chat template (one template for both
    engines)."""
    spec = importlib.util.spec_from_file_location("tiny_model", Path(__file__).with_name("tiny-model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CHAT_TEMPLATE


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", required=True, help="tokenizer-only GGUF to take the vocabulary from")
    ap.add_argument("--out", required=True, help="folder to write the model into")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ff", type=int, default=512)
    ap.add_argument("--context-length", type=int, default=131072,
                    help="max_position_embeddings; a server's --max-model-len decides its context")
    ap.add_argument("--seed", type=int, default=20240501)
    args = ap.parse_args()

    vocab = Path(args.vocab).resolve()
    tok = AutoTokenizer.from_pretrained(str(vocab.parent), gguf_file=vocab.name)
    tok.chat_template = chat_template()
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    if not isinstance(eot, int) or eot == tok.unk_token_id:
        sys.exit(f"tiny-hf-model.py: no <|eot_id|> in {vocab}: not the Llama-3 vocabulary")

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.ff,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context_length,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, eot] if tok.eos_token_id != eot else eot,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"tiny-hf-model.py: {n / 1e6:.1f}M parameters, vocabulary {len(tok)}, into {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
