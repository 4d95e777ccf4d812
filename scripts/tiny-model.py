#!/usr/bin/env python3
"""Writes a tiny Llama-architecture GGUF model with seeded random weights over
a real vocabulary, for tests that run a real llama-server on loopback.

The vocabulary comes from a tokenizer-only GGUF (llama.cpp ships
models/ggml-vocab-llama-bpe.gguf: the Llama-3 BPE tokenizer, 128,256 tokens,
no tensors): every tokenizer.* key is copied as it is, so the server tokenizes
exactly as it would for a real Llama-3 model. A Llama-3-format chat template
(header tokens, <|eot_id|>) is added, since the vocab file has none.

The weights are random (numpy's PCG64, fixed seed): the same arguments give
the same file, byte for byte, with the same gguf and numpy. The model says
nothing meaningful; it exists to exercise the server's real HTTP API,
tokenizer, slots, KV cache and metrics at CPU speed. Defaults: 2 layers,
embedding 64, 4 query heads of 16, 2 KV heads (grouped-query attention as in
Llama 3), FFN 256, f16 matrices with untied input and output embeddings
(~33 MB of the ~41 MB file), training context 131072 (as Llama 3.1) so that
a server's -c alone decides the per-slot context.

Needs: gguf==0.19.0 (PyPI; it brings numpy). Model files are build output:
never commit them.

Usage: tiny-model.py --vocab ggml-vocab-llama-bpe.gguf --out tiny.gguf
"""

import argparse
import os
import sys

import numpy as np

try:
    import gguf
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
except ImportError:
    sys.exit("tiny-model.py: needs the gguf package: pip install gguf==0.19.0")

ARCH = "llama"

# Llama-3 message format, written for this model: <|begin_of_text|>, then per
# message a header with the role and the content closed by <|eot_id|>, then an
# open assistant header when a reply is wanted.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] | trim -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)


def field_value(field):
    """The value of a reader field, and its GGUF type and array sub-type."""
    main = field.types[0]
    sub = field.types[-1] if main == GGUFValueType.ARRAY else None
    return field.contents(), main, sub


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", required=True, help="tokenizer-only GGUF to take the vocabulary from")
    ap.add_argument("--out", required=True, help="path of the model to write")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ff", type=int, default=256)
    ap.add_argument("--context-length", type=int, default=131072)
    ap.add_argument("--seed", type=int, default=20240501)
    ap.add_argument("--std", type=float, default=0.02, help="standard deviation of the random weights")
    args = ap.parse_args()

    if args.embd % args.heads or args.heads % args.kv_heads:
        sys.exit("tiny-model.py: embd must divide by heads, and heads by kv-heads")
    head_dim = args.embd // args.heads

    reader = GGUFReader(args.vocab)
    tok = {name: field_value(f) for name, f in reader.fields.items() if name.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in tok:
        sys.exit(f"tiny-model.py: {args.vocab} has no tokenizer.ggml.tokens")
    tokens = tok["tokenizer.ggml.tokens"][0]
    n_vocab = len(tokens)
    eot = tokens.index("<|eot_id|>") if "<|eot_id|>" in tokens else None

    w = GGUFWriter(args.out, ARCH)
    w.add_name("tiny-llama3-random")
    w.add_description(
        f"Random weights (seed {args.seed}) over the Llama-3 BPE vocabulary, for tests only; "
        f"{args.layers} layers, embedding {args.embd}, {args.heads}/{args.kv_heads} heads"
    )
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(args.context_length)
    w.add_embedding_length(args.embd)
    w.add_block_count(args.layers)
    w.add_feed_forward_length(args.ff)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)

    for name, (value, vtype, sub) in tok.items():
        w.add_key_value(name, value, vtype, sub)
    if "tokenizer.chat_template" not in tok:
        w.add_chat_template(CHAT_TEMPLATE)
    if eot is not None and "tokenizer.ggml.eot_token_id" not in tok:
        w.add_eot_token_id(eot)

    rng = np.random.default_rng(args.seed)

    def matrix(rows, cols):
        # numpy's shape is ggml's reversed: (rows, cols) is ne = [cols, rows].
        return (rng.standard_normal((rows, cols), dtype=np.float32) * args.std).astype(np.float16)

    def ones(n):
        return np.ones(n, dtype=np.float32)

    q_dim = args.heads * head_dim
    kv_dim = args.kv_heads * head_dim
    w.add_tensor("token_embd.weight", matrix(n_vocab, args.embd))
    for i in range(args.layers):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", ones(args.embd))
        w.add_tensor(f"{b}.attn_q.weight", matrix(q_dim, args.embd))
        w.add_tensor(f"{b}.attn_k.weight", matrix(kv_dim, args.embd))
        w.add_tensor(f"{b}.attn_v.weight", matrix(kv_dim, args.embd))
        w.add_tensor(f"{b}.attn_output.weight", matrix(args.embd, q_dim))
        w.add_tensor(f"{b}.ffn_norm.weight", ones(args.embd))
        w.add_tensor(f"{b}.ffn_gate.weight", matrix(args.ff, args.embd))
        w.add_tensor(f"{b}.ffn_up.weight", matrix(args.ff, args.embd))
        w.add_tensor(f"{b}.ffn_down.weight", matrix(args.embd, args.ff))
    w.add_tensor("output_norm.weight", ones(args.embd))
    w.add_tensor("output.weight", matrix(n_vocab, args.embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    size = os.path.getsize(args.out)
    print(
        f"tiny-model.py: wrote {args.out} ({size / 1e6:.1f} MB): {n_vocab} tokens, "
        f"{args.layers} layers, embd {args.embd}, heads {args.heads}/{args.kv_heads}, "
        f"ff {args.ff}, ctx {args.context_length}, seed {args.seed}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
