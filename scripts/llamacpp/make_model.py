"""Write a tiny llama-architecture GGUF with random weights and a real tokenizer.

No model hub is needed: the tokenizer and chat template come from one of the
vocab-only files in llama.cpp's tree (models/ggml-vocab-qwen2.gguf has a chatml
template), the weights are random (64-dim, 2 layers, 4 heads). Random weights
rarely emit end-of-generation, so the output rows of the EOG tokens are scaled up
to get a mix of `stop` and `length` finishes.

    python make_model.py LLAMA_CPP_TREE OUT.gguf [--seed 0]

Uses the gguf package vendored in the tree (gguf-py) and numpy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree", type=Path, help="llama.cpp source tree (vendor/llama.cpp of the sdist)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", default="qwen2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eog-scale", type=float, default=1.8)
    args = ap.parse_args()
    sys.path.insert(0, str(args.tree / "gguf-py"))
    import gguf  # the tree's own copy, matching its llama-server

    vocab = gguf.GGUFReader(str(args.tree / "models" / f"ggml-vocab-{args.vocab}.gguf"))

    def value(key: str):
        field = vocab.fields.get(key)
        return None if field is None else field.contents()

    tokens = value("tokenizer.ggml.tokens")
    n_vocab = len(tokens)
    n_embd, n_layer, n_head, n_ff, n_ctx = 64, 2, 4, 256, 32768
    rng = np.random.default_rng(args.seed)

    w = gguf.GGUFWriter(str(args.out), "llama")
    w.add_name("genq-tiny-random")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model(value("tokenizer.ggml.model"))
    if value("tokenizer.ggml.pre") is not None:
        w.add_tokenizer_pre(value("tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(value("tokenizer.ggml.token_type"))
    if value("tokenizer.ggml.merges") is not None:
        w.add_token_merges(value("tokenizer.ggml.merges"))
    for key, add in (("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
                     ("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
                     ("tokenizer.ggml.padding_token_id", w.add_pad_token_id)):
        if value(key) is not None:
            add(int(value(key)))
    if value("tokenizer.chat_template") is not None:
        w.add_chat_template(value("tokenizer.chat_template"))

    def rand(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd, scale=1.0))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    output = rand(n_vocab, n_embd, scale=0.1)
    # End-of-generation tokens: the eos id and chatml's <|im_end|> / <|endoftext|>.
    eog = {int(value("tokenizer.ggml.eos_token_id") or 0)}
    eog |= {i for i, t in enumerate(tokens) if t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")}
    for i in eog:
        output[i] *= args.eog_scale
    w.add_tensor("output.weight", output)
    for layer in range(n_layer):
        p = f"blk.{layer}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + name + ".weight", rand(n_embd, n_embd))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", rand(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", rand(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{args.out}: {n_vocab} tokens, EOG {sorted(eog)}")


if __name__ == "__main__":
    main()
