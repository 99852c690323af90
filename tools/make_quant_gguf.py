"""A pure Q4_0 / Q8_0 copy of a bf16 / f16 GGUF, for llama.cpp in side-by-side CPU benchmarks (speed only: the
sources are the random-weight GGUFs of the peers' make_gguf.py or tools/make_moe_gguf.py). It does what
`llama-quantize --pure` does for these two types, with gguf-py's own quantizers (numpy, bit-exact with ggml's
reference ones): every 2-D (or 3-D expert) `*.weight` is quantized, token_embd and output included; 1-D tensors
(norms, biases) and a MoE router (ffn_gate_inp) are copied as they are. The KV fields are copied with their
types, general.file_type becomes MOSTLY_Q4_0 / MOSTLY_Q8_0 and general.quantization_version is set; the tensors
keep their order.

Memory stays small: the source is read and quantized a slab of rows at a time (about 16 Mi elements), and only
one tensor's quantized bytes are held before they are written (the largest, an 8B model's token_embd in Q8_0,
is about 560 MB). The pages read and written are dropped from the page cache as it goes, so a 16 GB source does
not push other processes' files out of memory.

    python tools/make_quant_gguf.py --src /tmp/llamacpp/l8b-bf16.gguf --type q4_0 --out /tmp/llamacpp/l8b-q4_0.gguf \\
        [--llama-src /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

SLAB_ELEMENTS = 1 << 24  # rows quantized at once: about 64 MB of float32 plus the quantizer's temporaries


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True, help="a bf16 / f16 GGUF")
    ap.add_argument("--type", required=True, choices=["q4_0", "q8_0"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--llama-src", default="/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp")
    args = ap.parse_args()
    sys.path.insert(0, args.llama_src + "/gguf-py")
    import gguf

    qtype = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q8_0": gguf.GGMLQuantizationType.Q8_0}[args.type]
    ftype = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[args.type]
    if os.path.abspath(args.src) == os.path.abspath(args.out):
        raise SystemExit("--out must differ from --src")

    start = time.time()
    reader = gguf.GGUFReader(args.src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(args.out, arch)
    _copy_kv(gguf, reader, w)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    plan = []  # (tensor, quantize?) in the source's order
    for t in reader.tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))  # numpy order: rows first
        quantize = _quantizable(gguf, t, shape, block)
        if quantize:
            w.add_tensor_info(t.name, shape, np.dtype(np.float32), t.n_elements // block * type_size, raw_dtype=qtype)
        else:
            w.add_tensor_info(t.name, shape, np.dtype(np.float32), t.n_bytes, raw_dtype=t.tensor_type)
        plan.append((t, quantize))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    out_fd = w.fout[0].fileno()
    n_quant = 0
    with open(args.src, "rb") as src:
        for i, (t, quantize) in enumerate(plan):
            if quantize:
                data = _quantize_tensor(gguf, src, t, qtype, block, type_size)
                n_quant += 1
            else:
                data = _read(src, t.data_offset, t.n_bytes)
            w.write_tensor_data(data)
            del data
            _drop_cache(src.fileno(), t.data_offset, t.n_bytes)
            w.fout[0].flush()
            os.fdatasync(out_fd)
            _drop_cache(out_fd, 0, 0)  # everything written so far is on disk now
            if (i + 1) % 32 == 0 or i + 1 == len(plan):
                print(f"{i + 1}/{len(plan)} tensors, {time.time() - start:.0f} s", flush=True)
    w.close()
    size = os.path.getsize(args.out)
    print(f"wrote {args.out}: {n_quant} tensors {qtype.name}, {len(plan) - n_quant} kept, "
          f"{size / 2**30:.2f} GiB in {time.time() - start:.0f} s")


def _quantizable(gguf, t, shape: tuple[int, ...], block: int) -> bool:
    """What llama-quantize --pure turns into the target type (same rules, for the tensors these models have)."""
    T = gguf.GGMLQuantizationType
    return (t.tensor_type in (T.BF16, T.F16, T.F32) and len(shape) >= 2 and t.name.endswith("weight")
            and "ffn_gate_inp.weight" not in t.name and shape[-1] % block == 0)


def _quantize_tensor(gguf, src, t, qtype, block: int, type_size: int) -> np.ndarray:
    """The quantized bytes of one tensor, made a slab of rows at a time from the file (not from a memmap)."""
    T = gguf.GGMLQuantizationType
    cols = int(t.shape[0])
    rows = t.n_elements // cols
    in_row = t.n_bytes // rows
    out = np.empty((rows, cols // block * type_size), dtype=np.uint8)
    step = max(1, SLAB_ELEMENTS // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        raw = _read(src, t.data_offset + r * in_row, n * in_row)
        if t.tensor_type == T.BF16:
            x = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif t.tensor_type == T.F16:
            x = raw.view(np.float16).astype(np.float32)
        else:
            x = raw.view(np.float32)
        out[r:r + n] = gguf.quants.quantize(x.reshape(n, cols), qtype)
    return out


def _read(src, offset: int, nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    src.seek(offset)
    if src.readinto(memoryview(buf)) != nbytes:
        raise SystemExit(f"short read at {offset}: the source GGUF is truncated")
    return buf


def _drop_cache(fd: int, offset: int, nbytes: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def _copy_kv(gguf, reader, w) -> None:
    """Every KV field of the source with its type, except the ones the writer sets itself."""
    V = gguf.GGUFValueType
    skip = {"general.architecture", "general.file_type", "general.quantization_version", "general.alignment"}
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue
        kind = f.types[0]
        if kind == V.ARRAY:
            sub = f.types[-1]
            if len(f.types) != 2:
                raise SystemExit(f"{key}: nested arrays are not handled")
            if sub == V.STRING:
                values = [bytes(f.parts[i]) for i in f.data]  # raw bytes: written back unchanged
            else:
                values = [f.parts[i].tolist()[0] for i in f.data]
            if values:
                w.add_key_value(key, values, V.ARRAY, sub_type=sub)
        elif kind == V.STRING:
            w.add_key_value(key, bytes(f.parts[f.data[0]]), V.STRING)
        else:
            w.add_key_value(key, f.parts[f.data[0]].tolist()[0], kind)
    align = reader.fields.get("general.alignment")
    if align is not None:
        w.add_custom_alignment(int(align.parts[-1][0]))


if __name__ == "__main__":
    main()
