"""Write a tiny Qwen2ForCausalLM with random weights and a real tokenizer, for vLLM.

No model hub is needed: the Qwen2 tokenizer comes from the vocab-only GGUF in
llama.cpp's tree (models/ggml-vocab-qwen2.gguf of the llama-cpp-python sdist, read by
transformers' GGUF loader, which needs the `gguf` package), the weights are random
(hidden 128, 2 layers, 2 heads of 64, 1 KV head, tied embeddings, bf16: ~20 M
parameters). Random weights rarely emit <|im_end|>, so its embedding row (tied: also
its output row) is scaled up to get a mix of `stop` and `length` finishes when vLLM
samples at its default temperature 1: x48 gives, at max_tokens 128, lengths spread
over 25-128 with about a third cut at 128 (x16: none stop; at temperature 0 the random
model loops on one token and never stops, whatever the scale).

    VENV/bin/python make_model.py VOCAB.gguf OUT_DIR [--seed 0] [--eog-scale 48]

Runs in the vLLM venv (torch, transformers, gguf).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# ChatML, as Qwen2's own template renders it (the vocab file's template is the same
# idea; this one is what vLLM's chat endpoint applies).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("vocab", type=Path, help="ggml-vocab-qwen2.gguf")
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eog-scale", type=float, default=48.0)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(args.vocab.parent), gguf_file=args.vocab.name)
    tok.chat_template = CHATML
    end = tok.convert_tokens_to_ids("<|im_end|>")
    tok.eos_token = "<|im_end|>"
    torch.manual_seed(args.seed)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
        tie_word_embeddings=True, torch_dtype="bfloat16", eos_token_id=end, bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        model.model.embed_tokens.weight[end] *= args.eog_scale
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    # vLLM reads the stop token (and default sampling, none here) from generation_config.json.
    (args.out / "generation_config.json").write_text(json.dumps({"eos_token_id": end}))
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {len(tok)} tokens, {params / 1e6:.1f} M parameters, <|im_end|> = {end}")


if __name__ == "__main__":
    main()
