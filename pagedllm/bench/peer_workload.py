#!/usr/bin/env python3
"""One offline workload, the same for pagedllm and a peer engine (vLLM), run by that engine's own Python.

`bench compare` runs this file by path under each engine's interpreter (a vLLM venv has no pagedllm), so it imports
only the engine it measures and the standard library. Two parts, each printed as one JSON line:
- W: NUM_PROMPTS prompts of INPUT_LEN random token ids, OUTPUT_LEN tokens out each (ignore_eos, temperature 1.0,
  no per-request seed: vLLM 0.32's CPU sampler refuses one), all submitted at once: output tokens / wall time;
- batch 1: one such prompt alone: wall time / output tokens, in ms.
Dummy weights (load_format="dummy") from MODEL_DIR's config.json; token ids in, token ids out (no tokenizer).

Usage: python peer_workload.py ENGINE MODEL_DIR NUM_PROMPTS INPUT_LEN OUTPUT_LEN MAX_MODEL_LEN
"""
import json
import random
import sys
import time


def main(argv: list[str]) -> int:
    engine, model = argv[0], argv[1]
    num_prompts, input_len, output_len, max_model_len = (int(a) for a in argv[2:6])
    with open(f"{model}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(input_len)] for _ in range(num_prompts + 1)]
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                  max_model_len=max_model_len, max_num_seqs=num_prompts, seed=0)

        def prompt(ids):
            return TokensPrompt(prompt_token_ids=ids)

        def params(n):
            return SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, detokenize=False)
    elif engine == "pagedllm":
        from pagedllm import LLM, SamplingParams

        llm = LLM(model=model, load_format="dummy", dtype="bfloat16", max_model_len=max_model_len,
                  max_num_seqs=num_prompts, seed=0)

        def prompt(ids):
            return {"prompt_token_ids": ids}

        def params(n):
            return SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0)
    else:
        raise SystemExit(f"unknown engine {engine!r}: vllm or pagedllm")

    llm.generate([prompt(prompts[0])], params(8))  # warm-up: first-call costs out of the timings
    start = time.perf_counter()
    outs = llm.generate([prompt(p) for p in prompts[1:]], params(output_len))
    w_seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"part": "W", "output_tokens": tokens, "seconds": w_seconds,
                      "output_tok_s": tokens / w_seconds}), flush=True)
    start = time.perf_counter()
    one = llm.generate([prompt(prompts[0])], params(output_len))
    b1_seconds = time.perf_counter() - start
    n = len(one[0].outputs[0].token_ids)
    print(json.dumps({"part": "batch1", "output_tokens": n, "seconds": b1_seconds,
                      "ms_per_token": 1000 * b1_seconds / n}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
