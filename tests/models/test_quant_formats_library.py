"""The quantized-checkpoint writers of tests/quant_checkpoints.py: each format's layout and config, its
library's dequantization within the format's rounding of the original weights, the cross-checks between
libraries (compressed-tensors' AutoAWQConverter for AWQ and ModelOptNvfp4Converter for ModelOpt NVFP4,
transformers' convert_moe_packed_tensors for MXFP4, compressed-tensors' int4 packing for GPTQ), and the dense
references against transformers' own dequantizing loaders."""
from __future__ import annotations

import pytest
import torch

import tests.quant_checkpoints as qc
from tests.helpers import make_tiny_model

# Dims that every group size (32-128) and 128x128 FP8 blocks divide; q/k/v rows are multiples of 128.
BIG = dict(hidden_size=128, intermediate_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2)
FP8_MAX = 448.0
EPS = 1e-6
# GPTQ / AWQ store fp16 scales: an extreme value quantized with the rounded scale lands up to 7.5 rounding steps
# of it (7.5 * 2**-11 relative) past half a step, so their bound is scale/2 * (1 + 2**-6).
FP16_SCALE_SLACK = 1 + 2.0**-6


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", **BIG)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", moe_intermediate_size=64)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss")


def _deq_and_orig(src, dst):
    """(dequantized_state_dict(dst), original tensors of src), after checking they hold the same names."""
    deq, orig = qc.dequantized_state_dict(dst), qc.read_tensors(src)
    assert set(deq) == set(orig)
    return deq, orig


def _expand(scale: torch.Tensor, shape: torch.Size, rows: int, cols: int) -> torch.Tensor:
    """A per-tile scale grid broadcast to every element of a (out, in) weight; tiles are rows x cols."""
    return scale.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: shape[0], : shape[1]]


def _fp8_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest round-to-nearest error of w in e4m3 with this scale: half a step (3 mantissa bits), or half
    the subnormal step 2**-9 near zero."""
    return w.abs() * 2.0**-4 + scale * 2.0**-10 + EPS


def _fp4_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest error of w in E2M1 with this scale: half a step (0.25 below 2, 0.5 below 4, 1 up to 6: at most
    |q|/4), clipping included while |q| <= 8."""
    q = w / scale
    return scale * torch.clamp(q.abs() / 4, min=0.25) * (1 + 1e-6) + EPS


def _unchanged(deq, orig, quantized):
    for name, value in orig.items():
        if name.rpartition(".")[0] not in quantized:
            assert torch.equal(deq[name], value), name


def _assert_same_weights(model, tensors: dict[str, torch.Tensor], names: list[str]):
    params = dict(model.named_parameters())
    for name in names:
        assert torch.equal(params[name], tensors[name].float()), name


# -- compressed-tensors -----------------------------------------------------------------------------------
CT_CASES = [("fp8-channel", {}), ("fp8-tensor", {}), ("fp8-block", {}), ("w4a16", {"group_size": 32}),
            ("w4a16", {"group_size": 64}), ("w4a16", {"group_size": 128}), ("w4a16-asym", {"group_size": 64}),
            ("nvfp4a16", {})]
CT_FORMATS = {"fp8-channel": "float-quantized", "fp8-tensor": "float-quantized", "fp8-block": "float-quantized",
              "w4a16": "pack-quantized", "w4a16-asym": "pack-quantized", "nvfp4a16": "nvfp4-pack-quantized"}


@pytest.mark.parametrize("scheme,options", CT_CASES, ids=[f"{s}{o.get('group_size', '')}" for s, o in CT_CASES])
def test_compressed_tensors_layout_config_and_error_bound(qwen3, tmp_path, scheme, options):
    dst = qc.write_compressed_tensors(qwen3, tmp_path / "q", scheme, **options)
    cfg = qc.read_quantization_config(dst)
    assert cfg["quant_method"] == "compressed-tensors" and cfg["quantization_status"] == "compressed"
    assert cfg["format"] == CT_FORMATS[scheme] and cfg["ignore"] == ["lm_head"]
    (group,) = cfg["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    assert group["format"] == CT_FORMATS[scheme]

    tensors, (deq, orig) = qc.read_tensors(dst), _deq_and_orig(qwen3, dst)
    modules = qc.quantized_modules(orig)
    assert len(modules) == 2 * 7  # two layers of q/k/v/o/gate/up/down
    _unchanged(deq, orig, modules)
    for m in modules:
        w, d = orig[f"{m}.weight"], deq[f"{m}.weight"]
        assert d.shape == w.shape and d.dtype == torch.float32
        err = (d - w).abs()
        assert 0 < err.max() and not torch.equal(d, w), m  # really quantized
        scale = tensors[f"{m}.weight_scale"].float()
        if scheme.startswith("fp8"):
            assert tensors[f"{m}.weight"].dtype == torch.float8_e4m3fn and tensors[f"{m}.weight"].shape == w.shape
            if scheme == "fp8-channel":
                assert scale.shape == (w.shape[0], 1)
                assert torch.allclose(scale, w.abs().amax(1, keepdim=True) / FP8_MAX)
            elif scheme == "fp8-tensor":
                assert scale.shape == (1,) and torch.allclose(scale, w.abs().max() / FP8_MAX)
            else:
                assert scale.shape == (w.shape[0] // 128, w.shape[1] // 128)
                scale = _expand(scale, w.shape, 128, 128)
            assert (err <= _fp8_bound(w, scale)).all(), m
        elif scheme.startswith("w4a16"):
            gs = options["group_size"]
            assert tensors[f"{m}.weight_packed"].dtype == torch.int32
            assert tensors[f"{m}.weight_packed"].shape == (w.shape[0], w.shape[1] // 8)
            assert tensors[f"{m}.weight_shape"].tolist() == list(w.shape)
            assert scale.shape == (w.shape[0], w.shape[1] // gs)
            assert (f"{m}.weight_zero_point" in tensors) == (scheme == "w4a16-asym")
            assert (err <= _expand(scale, w.shape, 1, gs) / 2 * (1 + 1e-5) + EPS).all(), m
        else:
            assert tensors[f"{m}.weight_packed"].dtype == torch.uint8
            assert tensors[f"{m}.weight_packed"].shape == (w.shape[0], w.shape[1] // 2)
            assert tensors[f"{m}.weight_scale"].dtype == torch.float8_e4m3fn
            assert scale.shape == (w.shape[0], w.shape[1] // 16)
            global_scale = tensors[f"{m}.weight_global_scale"]
            assert global_scale.shape == (1,) and global_scale.dtype == torch.float32
            assert (err <= _fp4_bound(w, _expand(scale, w.shape, 1, 16) / global_scale)).all(), m


@pytest.mark.parametrize("scheme,options", [("fp8-block", {}), ("w4a16", {"group_size": 32}), ("fp8-channel", {})])
def test_compressed_tensors_transformers_loader_agrees_on_moe(qwen3_moe, tmp_path, scheme, options):
    """transformers (CompressedTensorsConfig(dequantize=True)) reads the per-expert tensors into its fused experts
    with exactly the values of the library's decompressors; the routers stay dense and ignored. (fp8-block
    passes here because these experts fit in one 128x128 tile.)"""
    dst = qc.write_compressed_tensors(qwen3_moe, tmp_path / "q", scheme, **options)
    cfg = qc.read_quantization_config(dst)
    assert cfg["ignore"] == ["lm_head", "model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]
    deq, orig = _deq_and_orig(qwen3_moe, dst)
    assert "model.layers.0.mlp.experts.3.up_proj.weight_scale" in qc.read_tensors(dst)
    model = qc.load_with_transformers(dst)
    experts = model.model.layers[0].mlp.experts
    gate_up = torch.cat([deq["model.layers.0.mlp.experts.5.gate_proj.weight"],
                         deq["model.layers.0.mlp.experts.5.up_proj.weight"]])
    assert torch.equal(experts.gate_up_proj[5], gate_up)
    assert torch.equal(experts.down_proj[5], deq["model.layers.0.mlp.experts.5.down_proj.weight"])
    _assert_same_weights(model, deq, ["model.layers.1.mlp.down_proj.weight", "model.layers.2.self_attn.k_proj.weight",
                                      "model.layers.0.mlp.gate.weight"])
    assert not torch.equal(deq["model.layers.1.mlp.down_proj.weight"], orig["model.layers.1.mlp.down_proj.weight"])


def test_asymmetric_moe_reference_avoids_transformers_experts_path(qwen3_moe, tmp_path):
    """transformers 5's fused-experts decompression drops int4 zero points (it raises), so the reference of an
    asymmetric MoE checkpoint is built from the library's decompressors instead."""
    dst = qc.write_compressed_tensors(qwen3_moe, tmp_path / "q", "w4a16-asym", group_size=32)
    assert not qc._transformers_can_dequantize(dst, qc.read_quantization_config(dst))
    with pytest.raises(Exception, match="conversion of the weights"):  # transformers reports the failed conversion
        qc.load_with_transformers(dst)
    deq = qc.dequantized_state_dict(dst)
    experts = qc.dequantized_reference(dst).model.layers[2].mlp.experts
    assert torch.equal(experts.down_proj[1], deq["model.layers.2.mlp.experts.1.down_proj.weight"])


def test_compressed_tensors_rejects_groups_that_do_not_divide(tmp_path):
    src = make_tiny_model(tmp_path / "small", "qwen3")  # hidden 64
    with pytest.raises(ValueError, match="group_size 128"):
        qc.write_compressed_tensors(src, tmp_path / "q", "w4a16", group_size=128)


# -- block FP8 (quant_method fp8) ------------------------------------------------------------------------
@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_fp8_block_layout_config_and_error_bound(qwen3, tmp_path, block):
    dst = qc.write_fp8_block(qwen3, tmp_path / "q", block=block)
    assert qc.read_quantization_config(dst) == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                "weight_block_size": list(block), "fmt": "e4m3"}
    tensors, (deq, orig) = qc.read_tensors(dst), _deq_and_orig(qwen3, dst)
    modules = qc.quantized_modules(orig)
    _unchanged(deq, orig, modules)
    bn, bk = block
    for m in modules:
        w, q, s = orig[f"{m}.weight"], tensors[f"{m}.weight"], tensors[f"{m}.weight_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
        assert s.dtype == torch.float32 and s.shape == (w.shape[0] // bn, w.shape[1] // bk)
        tile_amax = w.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk)).abs().amax(dim=(1, 3))
        assert torch.allclose(s, tile_amax / FP8_MAX, rtol=1e-6)
        err = (deq[f"{m}.weight"] - w).abs()
        assert 0 < err.max() and (err <= _fp8_bound(w, _expand(s, w.shape, bn, bk))).all(), m
    # transformers' FP8 loader (CPU: dequantizes) reads the same values
    _assert_same_weights(qc.load_with_transformers(dst), deq, [f"{m}.weight" for m in modules])


def test_fp8_block_ragged_edges(tmp_path):
    """Dims that are not multiples of the block: scale grid ceil(out/bn) x ceil(in/bk), edge tiles partial."""
    src = make_tiny_model(tmp_path / "small", "qwen3")  # q_proj (128, 64), k_proj (64, 64), o_proj (64, 128)
    dst = qc.write_fp8_block(src, tmp_path / "q", block=(48, 48))
    tensors, (deq, orig) = qc.read_tensors(dst), _deq_and_orig(src, dst)
    for m in qc.quantized_modules(orig):
        w, s = orig[f"{m}.weight"], tensors[f"{m}.weight_scale_inv"]
        assert s.shape == (-(-w.shape[0] // 48), -(-w.shape[1] // 48))
        assert torch.allclose(s[-1, -1], w[(s.shape[0] - 1) * 48:, (s.shape[1] - 1) * 48:].abs().max() / FP8_MAX)
        err = (deq[f"{m}.weight"] - w).abs()
        assert (err <= _fp8_bound(w, _expand(s, w.shape, 48, 48))).all(), m
    # transformers' Fp8Dequantize needs whole tiles: the reference comes from compressed-tensors' FP8BlockDequantizer
    assert not qc._transformers_can_dequantize(dst, qc.read_quantization_config(dst))
    _assert_same_weights(qc.dequantized_reference(dst), deq, list(deq))


# -- GPTQ ---------------------------------------------------------------------------------------------------
def test_int4_packing_bit_order():
    rows = torch.arange(16).remainder(8).view(16, 1).expand(16, 3)  # value of input row 8r+j is j
    assert (qc.pack_int4_rows(rows) == 0x76543210).all()
    cols = torch.arange(16).remainder(8).view(1, 16).expand(2, 16)  # value of column 8c+j is j
    assert (qc.pack_int4_cols(cols) == 0x76543210).all()
    # AWQ: nibble p holds column ORDER[p] = 0,2,4,6,1,3,5,7
    assert (qc.pack_int4_cols(cols, qc.AWQ_ORDER) == 0x75316420).all()
    # words with the top bit set come out as negative int32, and unpack back
    q = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(qc.unpack_int4_rows(qc.pack_int4_rows(q)), q)
    assert torch.equal(qc.unpack_int4_cols(qc.pack_int4_cols(q, qc.AWQ_ORDER), qc.AWQ_ORDER), q)


GPTQ_CASES = [(128, True, False, "gptq"), (64, True, False, "gptq"), (32, False, False, "gptq"),
              (32, True, True, "gptq"), (64, False, True, "gptq"), (64, False, False, "gptq_v2")]


@pytest.mark.parametrize("group_size,sym,desc_act,fmt", GPTQ_CASES)
def test_gptq_layout_config_and_error_bound(qwen3, tmp_path, group_size, sym, desc_act, fmt):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    dst = qc.write_gptq(qwen3, tmp_path / "q", group_size=group_size, sym=sym, desc_act=desc_act,
                        checkpoint_format=fmt)
    assert qc.read_quantization_config(dst) == {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
        "checkpoint_format": fmt, "true_sequential": True, "damp_percent": 0.01, "static_groups": False}
    tensors, (deq, orig) = qc.read_tensors(dst), _deq_and_orig(qwen3, dst)
    modules = qc.quantized_modules(orig)
    _unchanged(deq, orig, modules)
    for m in modules:
        w = orig[f"{m}.weight"]
        out_f, in_f = w.shape
        groups = in_f // group_size
        qweight, qzeros, scales, g_idx = (tensors[f"{m}.{n}"] for n in ("qweight", "qzeros", "scales", "g_idx"))
        assert qweight.dtype == torch.int32 and qweight.shape == (in_f // 8, out_f)
        assert qzeros.dtype == torch.int32 and qzeros.shape == (groups, out_f // 8)
        assert scales.dtype == torch.float16 and scales.shape == (groups, out_f)
        assert g_idx.dtype == torch.int32 and g_idx.shape == (in_f,)
        assert torch.bincount(g_idx.long()).tolist() == [group_size] * groups
        sequential = torch.equal(g_idx.long(), torch.arange(in_f) // group_size)
        assert sequential != desc_act
        # the bit layout agrees with compressed-tensors' independent int4 packing (values stored as q - 8)
        as_signed = lambda v: (v - 8).to(torch.int8)  # noqa: E731
        assert torch.equal(pack_to_int32(as_signed(qc.unpack_int4_rows(qweight)), 4, packed_dim=0), qweight)
        assert torch.equal(pack_to_int32(as_signed(qc.unpack_int4_cols(qzeros)), 4, packed_dim=1), qzeros)
        stored_zero = qc.unpack_int4_cols(qzeros) + (1 if fmt == "gptq" else 0)
        if sym:
            assert (stored_zero == 8).all()
        err = (deq[f"{m}.weight"] - w).abs()
        bound = scales.float()[g_idx.long()].t() / 2 * FP16_SCALE_SLACK + EPS
        assert 0 < err.max() and (err <= bound).all(), m


# -- AWQ ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_layout_config_and_compressed_tensors_converter(qwen3, tmp_path, group_size):
    dst = qc.write_awq(qwen3, tmp_path / "q", group_size=group_size)
    assert qc.read_quantization_config(dst) == {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                                "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    tensors, (deq, orig) = qc.read_tensors(dst), _deq_and_orig(qwen3, dst)  # deq: AutoAWQConverter + decompress
    modules = qc.quantized_modules(orig)
    _unchanged(deq, orig, modules)
    for m in modules:
        w = orig[f"{m}.weight"]
        out_f, in_f = w.shape
        qweight, qzeros, scales = (tensors[f"{m}.{n}"] for n in ("qweight", "qzeros", "scales"))
        assert qweight.dtype == torch.int32 and qweight.shape == (in_f, out_f // 8)
        assert qzeros.dtype == torch.int32 and qzeros.shape == (in_f // group_size, out_f // 8)
        assert scales.dtype == torch.float16 and scales.shape == (in_f // group_size, out_f)
        spec = qc.awq_dequantize_module(qweight, qzeros, scales)
        assert torch.equal(deq[f"{m}.weight"], spec), m  # compressed-tensors' converter == the spec, exactly
        assert qc.unpack_int4_cols(qzeros, qc.AWQ_ORDER).float().std() > 0  # real zero points, not one constant
        err = (spec - w).abs()
        bound = scales.float().repeat_interleave(group_size, 0).t() / 2 * FP16_SCALE_SLACK + EPS
        assert 0 < err.max() and (err <= bound).all(), m


def test_awq_order_is_not_plain_order(qwen3, tmp_path):
    """Reading AWQ words in plain nibble order gives different weights: the test above pins the AWQ order."""
    dst = qc.write_awq(qwen3, tmp_path / "q", group_size=64)
    t = qc.read_tensors(dst)
    m = "model.layers.0.mlp.up_proj"
    plain = qc.unpack_int4_cols(t[f"{m}.qweight"])
    assert not torch.equal(plain, qc.unpack_int4_cols(t[f"{m}.qweight"], qc.AWQ_ORDER))


# -- MXFP4 (gpt-oss) ----------------------------------------------------------------------------------------
FP4_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mxfp4_spec_dequant(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP MX: (E, out, in/32, 16) nibbles (low first) x 2**(scale - 127) -> (E, in, out) x @ W layout."""
    values = torch.stack([FP4_LUT[(blocks & 0xF).long()], FP4_LUT[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = values * torch.exp2(scales.float() - 127).unsqueeze(-1)  # (E, out, in/32, 32)
    return values.flatten(-2).transpose(1, 2)


def test_mxfp4_layout_config_and_transformers_dequantizer(gpt_oss, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dst = qc.write_mxfp4_gpt_oss(gpt_oss, tmp_path / "q")
    assert qc.read_quantization_config(dst) == {"quant_method": "mxfp4",
                                                "modules_to_not_convert": qc.MXFP4_NOT_CONVERTED}
    tensors, orig = qc.read_tensors(dst), qc.read_tensors(gpt_oss)
    experts, width, hidden = 4, 64, 64
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts."
        assert tensors[p + "gate_up_proj_blocks"].shape == (experts, 2 * width, hidden // 32, 16)
        assert tensors[p + "gate_up_proj_scales"].shape == (experts, 2 * width, hidden // 32)
        assert tensors[p + "down_proj_blocks"].shape == (experts, hidden, width // 32, 16)
        assert tensors[p + "down_proj_scales"].shape == (experts, hidden, width // 32)
        assert torch.equal(tensors[p + "gate_up_proj_bias"], orig[p + "gate_up_proj_bias"])
        assert torch.equal(tensors[p + "down_proj_bias"], orig[p + "down_proj_bias"])
        assert p + "gate_up_proj" not in tensors and p + "down_proj" not in tensors
        for proj in ("gate_up_proj", "down_proj"):
            blocks, scales = tensors[f"{p}{proj}_blocks"], tensors[f"{p}{proj}_scales"]
            assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8
            spec = _mxfp4_spec_dequant(blocks, scales)
            assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), spec)
            w = orig[p + proj]
            assert spec.shape == w.shape
            scale = torch.exp2(scales.float() - 127).repeat_interleave(32, -1).transpose(1, 2)
            err = (spec - w).abs()
            assert 0 < err.max() and (err <= _fp4_bound(w, scale)).all(), proj
    deq = qc.dequantized_state_dict(dst)
    assert set(deq) == set(orig)
    _unchanged(deq, orig, {f"model.layers.{i}.mlp.experts" for i in range(3)})
    # transformers' own loader (Mxfp4Config(dequantize=True)) reads the same experts
    model = qc.load_with_transformers(dst)
    _assert_same_weights(model, deq, ["model.layers.1.mlp.experts.gate_up_proj",
                                      "model.layers.2.mlp.experts.down_proj"])


def test_mxfp4_needs_gpt_oss(qwen3, tmp_path):
    with pytest.raises(ValueError, match="gpt-oss"):
        qc.write_mxfp4_gpt_oss(qwen3, tmp_path / "q")


# -- NVIDIA ModelOpt ------------------------------------------------------------------------------------
MODELOPT_LEAVES = {"FP8": {"weight", "weight_scale", "input_scale"},
                   "NVFP4": {"weight", "weight_scale", "weight_scale_2", "input_scale"}}


@pytest.mark.parametrize("algo", ["FP8", "NVFP4"])
def test_modelopt_layout_config_and_error_bound(qwen3, tmp_path, algo):
    """ModelOpt's names, dtypes and shapes hold compressed-tensors' own fp8-tensor / nvfp4a16 values (NVFP4's
    weight_scale_2 the inverse of CT's global scale); read back by the library (ModelOptNvfp4Converter + its
    dequantize, or the float-quantized decompressor) they are CT's values, within the format's rounding."""
    dst = qc.write_modelopt(qwen3, tmp_path / "q", algo)
    ct = qc.write_compressed_tensors(qwen3, tmp_path / "ct", "fp8-tensor" if algo == "FP8" else "nvfp4a16")
    assert qc.read_quantization_config(dst) == {"quant_method": "modelopt", "quant_algo": algo,
                                                "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"],
                                                **({"group_size": 16} if algo == "NVFP4" else {})}
    tensors, ct_tensors, (deq, orig) = qc.read_tensors(dst), qc.read_tensors(ct), _deq_and_orig(qwen3, dst)
    ct_deq = qc.dequantized_state_dict(ct)
    modules = qc.quantized_modules(orig)
    assert len(modules) == 2 * 7
    _unchanged(deq, orig, modules)
    for m in modules:
        assert {k.rpartition(".")[2] for k in tensors if k.rpartition(".")[0] == m} == MODELOPT_LEAVES[algo], m
        w, q, s, d = orig[f"{m}.weight"], tensors[f"{m}.weight"], tensors[f"{m}.weight_scale"], deq[f"{m}.weight"]
        x = tensors[f"{m}.input_scale"]
        assert x.dtype == torch.float32 and x.shape == () and x.item() == 1.0
        assert d.dtype == torch.float32 and d.shape == w.shape
        err = (d - w).abs()
        assert 0 < err.max(), m
        if algo == "FP8":
            assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
            assert torch.equal(q.view(torch.uint8), ct_tensors[f"{m}.weight"].view(torch.uint8))
            assert s.dtype == torch.float32 and s.shape == () and torch.allclose(s, w.abs().max() / FP8_MAX)
            assert torch.equal(d, q.float() * s) and torch.equal(d, ct_deq[f"{m}.weight"])
            assert (err <= _fp8_bound(w, s)).all(), m
        else:
            s2 = tensors[f"{m}.weight_scale_2"]
            assert q.dtype == torch.uint8 and q.shape == (w.shape[0], w.shape[1] // 2)
            assert torch.equal(q, ct_tensors[f"{m}.weight_packed"])
            assert s.dtype == torch.float8_e4m3fn and s.shape == (w.shape[0], w.shape[1] // 16)
            assert torch.equal(s.view(torch.uint8), ct_tensors[f"{m}.weight_scale"].view(torch.uint8))
            assert s2.dtype == torch.float32 and s2.shape == ()
            assert torch.allclose(s2 * ct_tensors[f"{m}.weight_global_scale"], torch.ones(1), rtol=1e-6, atol=0)
            # 1 / (1 / g) is g to float32 rounding, so the two libraries' readings agree to it
            assert torch.allclose(d, ct_deq[f"{m}.weight"], rtol=1e-6, atol=0)
            assert (err <= _fp4_bound(w, _expand(s, w.shape, 1, 16) * s2)).all(), m


def test_modelopt_broken_layouts_fail(qwen3, tmp_path):
    """compressed-tensors' converter takes the NVFP4 layout as written, but not a packed weight stored as int8 (its
    scales are then orphans); a per-row FP8 scale is not ModelOpt's per-tensor FP8."""
    from compressed_tensors.entrypoints.convert.converters import ModelOptNvfp4Converter

    tensors = qc.read_tensors(qc.write_modelopt(qwen3, tmp_path / "nvfp4", "NVFP4"))
    converter = ModelOptNvfp4Converter(ignore=["lm_head"])
    assert "model.layers.0.mlp.down_proj.weight_packed" in converter.validate(dict(tensors))
    m = "model.layers.0.mlp.down_proj"
    tensors[f"{m}.weight"] = tensors[f"{m}.weight"].view(torch.int8)
    with pytest.raises(ValueError, match=f"without a converted weight_packed.*{m}.weight_scale"):
        converter.validate(tensors)
    dst = qc.write_modelopt(qwen3, tmp_path / "fp8", "FP8")
    tensors = qc.read_tensors(dst)
    tensors[f"{m}.weight_scale"] = tensors[f"{m}.weight_scale"].expand(tensors[f"{m}.weight"].shape[0])
    with pytest.raises(ValueError, match="one scale"):
        qc._modelopt_dequantize(tensors, qc.read_quantization_config(dst))


def test_modelopt_moe_routers_excluded_and_transformers_skips_modelopt(qwen3_moe, tmp_path):
    """Routers stay dense and are listed in exclude_modules. transformers 5 has no modelopt loader: it skips the
    quantization and loads the raw fp8 codes as weights, so the reference is built from dequantized_state_dict."""
    from transformers import AutoModelForCausalLM

    dst = qc.write_modelopt(qwen3_moe, tmp_path / "q", "FP8")
    cfg = qc.read_quantization_config(dst)
    assert cfg["exclude_modules"] == ["lm_head", "model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]
    tensors, orig = qc.read_tensors(dst), qc.read_tensors(qwen3_moe)
    assert torch.equal(tensors["model.layers.0.mlp.gate.weight"], orig["model.layers.0.mlp.gate.weight"])
    assert tensors["model.layers.0.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert not qc._transformers_can_dequantize(dst, cfg)
    name = "model.layers.1.self_attn.q_proj.weight"
    params = dict(AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32).named_parameters())
    assert torch.equal(params[name], tensors[name].float())
    assert not torch.equal(params[name], qc.dequantized_state_dict(dst)[name])


# -- dense references -----------------------------------------------------------------------------------
REFERENCE_CASES = {
    "ct-w4a16": lambda src, dst: qc.write_compressed_tensors(src, dst, "w4a16", group_size=64),
    "ct-nvfp4a16": lambda src, dst: qc.write_compressed_tensors(src, dst, "nvfp4a16"),
    "fp8-block": lambda src, dst: qc.write_fp8_block(src, dst),
    "gptq-act-order": lambda src, dst: qc.write_gptq(src, dst, group_size=32, desc_act=True),
    "awq": lambda src, dst: qc.write_awq(src, dst, group_size=64),
    "modelopt-fp8": lambda src, dst: qc.write_modelopt(src, dst, "FP8"),
    "modelopt-nvfp4": lambda src, dst: qc.write_modelopt(src, dst, "NVFP4"),
}


@pytest.mark.parametrize("case", sorted(REFERENCE_CASES))
def test_dequantized_reference_holds_the_dequantized_weights(qwen3, tmp_path, case):
    dst = REFERENCE_CASES[case](qwen3, tmp_path / case)
    deq = qc.dequantized_state_dict(dst)
    ref = qc.dequantized_reference(dst)
    assert qc.dequantized_reference(dst) is ref  # cached per path
    params = dict(ref.named_parameters())
    assert set(params) == set(deq) and all(p.dtype == torch.float32 for p in params.values())
    _assert_same_weights(ref, deq, list(deq))
    ids, logprobs = qc.hf_greedy_reference(dst, [5, 6, 7, 8, 9], 4)
    assert len(ids) == 4 and all(lp <= 0 for lp in logprobs)


def test_reference_paths_agree(qwen3, tmp_path):
    """Where transformers dequantizes (compressed-tensors int4 here), the reference it loads equals the one
    built from dequantized_state_dict, parameter for parameter, and so do their greedy outputs."""
    dst = qc.write_compressed_tensors(qwen3, tmp_path / "q", "w4a16-asym", group_size=32)
    assert qc._transformers_can_dequantize(dst, qc.read_quantization_config(dst))
    via_transformers, via_dense = qc.load_with_transformers(dst), qc._load_dense(dst)
    dense_params = dict(via_dense.named_parameters())
    for name, param in via_transformers.named_parameters():
        assert torch.equal(param, dense_params[name]), name
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(via_transformers(prompt).logits, via_dense(prompt).logits)


def test_gpt_oss_mxfp4_greedy_reference(gpt_oss, tmp_path):
    dst = qc.write_mxfp4_gpt_oss(gpt_oss, tmp_path / "q")
    ids, logprobs = qc.hf_greedy_reference(dst, [5, 6, 7, 8, 9], 3)
    assert len(ids) == 3 and all(lp <= 0 for lp in logprobs)


def test_nvfp4_transformers_loader_rounds_to_bfloat16(qwen3, tmp_path):
    """Why the NVFP4 reference is built from the library's float32 dequantize: transformers' loader goes through
    the compressor's decompress, which gives exactly the bfloat16 rounding of those values."""
    dst = qc.write_compressed_tensors(qwen3, tmp_path / "q", "nvfp4a16")
    assert not qc._transformers_can_dequantize(dst, qc.read_quantization_config(dst))
    deq, params = qc.dequantized_state_dict(dst), dict(qc.load_with_transformers(dst).named_parameters())
    name = "model.layers.1.mlp.gate_proj.weight"
    assert torch.equal(params[name], deq[name].bfloat16().float()) and not torch.equal(params[name], deq[name])
