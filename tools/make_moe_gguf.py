"""A random-weight GGUF of a Qwen3-MoE config.json, for llama.cpp in side-by-side CPU benchmarks (speed only:
the weights are noise). The peers' make_gguf.py (../shared/peers/llama.cpp) writes dense Llama / Qwen2 shapes;
this writes llama.cpp's `qwen3moe` architecture: q/k norms, a router (ffn_gate_inp) and each layer's experts
stacked (ffn_gate_exps, ffn_up_exps, ffn_down_exps). The tokenizer fields come from the vocab-only GGUF that
llama.cpp's tree ships for Qwen2.

    python tools/make_moe_gguf.py --config tools/bench-configs/qwen3-moe-4-layers.json \\
        --out /tmp/llamacpp/qwen3moe-4l-bf16.gguf [--llama-src /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp]
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--llama-src", default="/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp")
    args = ap.parse_args()
    sys.path.insert(0, args.llama_src + "/gguf-py")
    import gguf

    cfg = json.load(open(args.config))
    if cfg["architectures"] != ["Qwen3MoeForCausalLM"] or cfg.get("mlp_only_layers"):
        raise SystemExit("a Qwen3MoeForCausalLM config with every layer sparse is what this writes")
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    experts, width = cfg["num_experts"], cfg["moe_intermediate_size"]

    w = gguf.GGUFWriter(args.out, "qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(width)
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    _copy_tokenizer(gguf, w, f"{args.llama_src}/models/ggml-vocab-qwen2.gguf", vocab)

    gen = torch.Generator().manual_seed(0)

    def add(name: str, *shape: int) -> None:
        t = torch.randn(*shape, generator=gen) * 0.02
        if len(shape) == 1:  # norms: float32, around 1
            w.add_tensor(name, (t + 1).numpy())
        else:
            w.add_tensor(name, t.bfloat16().view(torch.int16).numpy().view(np.uint16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)

    add("token_embd.weight", vocab, h)
    add("output_norm.weight", h)
    add("output.weight", vocab, h)
    for i in range(layers):
        p = f"blk.{i}."
        for name, shape in (("attn_norm.weight", (h,)), ("ffn_norm.weight", (h,)),
                            ("attn_q.weight", (heads * head_dim, h)), ("attn_k.weight", (kv_heads * head_dim, h)),
                            ("attn_v.weight", (kv_heads * head_dim, h)), ("attn_output.weight", (h, heads * head_dim)),
                            ("attn_q_norm.weight", (head_dim,)), ("attn_k_norm.weight", (head_dim,)),
                            ("ffn_gate_inp.weight", (experts, h)), ("ffn_gate_exps.weight", (experts, width, h)),
                            ("ffn_up_exps.weight", (experts, width, h)), ("ffn_down_exps.weight", (experts, h, width))):
            add(p + name, *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", args.out)


def _copy_tokenizer(gguf, w, vocab_gguf: str, vocab: int) -> None:
    """The tokenizer.* fields of a vocab-only GGUF (its lists cut to the model's vocabulary)."""
    reader = gguf.GGUFReader(vocab_gguf)
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.chat_template":
            continue
        kind = f.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            if f.types[1] == gguf.GGUFValueType.STRING:
                values = [bytes(f.parts[i]).decode("utf-8", errors="surrogateescape") for i in f.data]
            else:
                values = [f.parts[i].tolist()[0] for i in f.data]
            w.add_array(key, values[:vocab])
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(key, bytes(f.parts[f.data[0]]).decode())
        else:
            w.add_key_value(key, f.parts[f.data[0]].tolist()[0], kind)


if __name__ == "__main__":
    main()
