"""Tests for the built-in demo model and the tiny-checkpoint test helpers."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import demo
from tests.helpers import ARCHS, hf_greedy, load_hf_model, make_tiny_model

transformers = pytest.importorskip("transformers")
AutoTokenizer = transformers.AutoTokenizer
AutoConfig = transformers.AutoConfig


# ---------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def demo_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo_tok")
    demo.build_tokenizer(path)
    return path


def test_tokenizer_files_and_determinism(demo_tokenizer_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (demo_tokenizer_dir / name).is_file()
    demo.build_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (demo_tokenizer_dir / name).read_bytes()
    cfg = json.loads((demo_tokenizer_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["bos_token"] == "<|begin_of_text|>" and cfg["eos_token"] == "<|end_of_text|>"


@pytest.mark.parametrize("text", ["héllo 日本 🙂", "Once upon a time, there was a cat.\n\nThe end!", "  tabs\tand  spaces ", ""])
def test_tokenizer_roundtrip_unicode(demo_tokenizer_dir: Path, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_bos_prepended(demo_tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    assert tok.bos_token_id == demo.DEMO_CONFIG["bos_token_id"]
    assert tok.eos_token_id == demo.DEMO_CONFIG["eos_token_id"]
    assert tok.pad_token == "<|pad|>"
    with_bos = tok("Once upon a time").input_ids
    without = tok("Once upon a time", add_special_tokens=False).input_ids
    assert with_bos == [tok.bos_token_id] + without
    assert len(tok) == demo.DEMO_CONFIG["vocab_size"]


def test_chat_template(demo_tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    no_prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("Hi there!<|eot_id|>")
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert ids.count(eot) == 2


# ---------------------------------------------------------------- tiny models


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads_and_generates(tiny_models: dict[str, Path], arch: str) -> None:
    path = tiny_models[arch]
    raw = json.loads((path / "config.json").read_text())
    cfg = AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert cfg.vocab_size >= len(tok)
    assert "rope_theta" in raw and "rope_scaling" in raw and "rope_parameters" not in raw
    model = load_hf_model(path)
    names = dict(model.named_parameters())
    if arch == "llama":
        assert raw["rope_scaling"]["rope_type"] == "llama3"
        assert cfg.rope_parameters["rope_type"] == "llama3"
        assert cfg.rope_parameters["original_max_position_embeddings"] == 128
        assert not cfg.tie_word_embeddings and "lm_head.weight" in names
    elif arch == "mistral":
        assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads
        assert cfg.sliding_window is None
        assert names["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    elif arch == "qwen2":
        assert cfg.tie_word_embeddings and cfg.num_key_value_heads == 1
        assert "model.layers.0.self_attn.q_proj.bias" in names
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    elif arch == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in names
        assert cfg.head_dim == 32 and cfg.rope_parameters["rope_theta"] == 1e6
    gen_cfg = json.loads((path / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == tok.eos_token_id and gen_cfg["bos_token_id"] == tok.bos_token_id

    prompt = tok("Once upon a time").input_ids
    ids, logprobs = hf_greedy(path, prompt, 8)
    assert len(ids) == len(logprobs) == 8
    # Reference check: teacher-forced forward pass agrees with generate's argmax and logprobs.
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    assert logits.argmax(-1).tolist() == ids
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    assert torch.allclose(lp, torch.tensor(logprobs), atol=1e-4)
    # Weights are scaled so greedy choices have clear margins (not near-uniform logits).
    assert max(logprobs) > -3.0


def test_rope_scaling_override(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", "llama", rope_scaling={"type": "linear", "factor": 2.0}, num_hidden_layers=1)
    raw = json.loads((path / "config.json").read_text())
    assert raw["rope_scaling"] == {"type": "linear", "factor": 2.0}
    assert raw["num_hidden_layers"] == 1
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.rope_parameters["rope_type"] == "linear" and cfg.rope_parameters["factor"] == 2.0
    assert len(hf_greedy(path, [0, 5, 6], 3)[0]) == 3


def test_sharded_save(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    path = make_tiny_model(tmp_path / "sharded", "qwen2", shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (path / "model.safetensors").exists()
    assert all((path / f).is_file() for f in files)
    # Same seed and config as the unsharded fixture model: identical weights and greedy tokens
    # (logprobs only up to float noise: BLAS paths depend on buffer alignment).
    ref = load_hf_model(tiny_models["qwen2"]).state_dict()
    got = load_hf_model(path).state_dict()
    assert sorted(ref) == sorted(got) and all(torch.equal(ref[k], got[k]) for k in ref)
    prompt = [0, 17, 42, 99]
    ids, lps = hf_greedy(path, prompt, 6)
    ref_ids, ref_lps = hf_greedy(tiny_models["qwen2"], prompt, 6)
    assert ids == ref_ids
    assert lps == pytest.approx(ref_lps, abs=1e-4)


def test_hf_greedy_ignore_eos(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    path = tmp_path / "eos"
    shutil.copytree(tiny_models["llama"], path)
    prompt = [0, 11, 12, 13]
    first = hf_greedy(path, prompt, 1)[0][0]
    # Make the first greedy token the model's eos.
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = first
    gen_path.write_text(json.dumps(gen))
    from tests import helpers

    helpers._HF_MODELS.pop(str(path.resolve()), None)
    assert len(hf_greedy(path, prompt, 5, ignore_eos=True)[0]) == 5
    assert hf_greedy(path, prompt, 5, ignore_eos=False)[0] == [first]


# ---------------------------------------------------------------- demo model


@pytest.fixture(scope="module")
def demo_cache() -> tuple[Path, Path, float]:
    """The demo model as this test run builds it (once, fresh, in the run's cache: tests/conftest.py, shared with
    the demo servers); (cache_root, model_path, mtime)."""
    path = demo.demo_model_path()
    return demo._cache_root(), path, (path / "model.safetensors").stat().st_mtime


def test_demo_model_path_builds_once(demo_cache: tuple[Path, Path, float], monkeypatch: pytest.MonkeyPatch) -> None:
    root, path, mtime = demo_cache
    assert path == root / "demo-llama-v1"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    # No temp leftovers: the model and the lock file that keeps two builds from running at once.
    assert sorted(p.name for p in root.iterdir() if "demo" in p.name) == [".demo-llama-v1.lock", "demo-llama-v1"]

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("demo model rebuilt")

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(root))
    monkeypatch.setattr(demo, "build_demo_model", fail)
    assert demo.demo_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime == mtime


def test_demo_model_config(demo_cache: tuple[Path, Path, float]) -> None:
    _, path, _ = demo_cache
    raw = json.loads((path / "config.json").read_text())
    for key, value in demo.DEMO_CONFIG.items():
        assert raw[key] == value, key
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == demo.DEMO_CONFIG["eos_token_id"]
    assert gen["bos_token_id"] == demo.DEMO_CONFIG["bos_token_id"]


def test_demo_model_is_trained(demo_cache: tuple[Path, Path, float]) -> None:
    _, path, _ = demo_cache
    model = load_hf_model(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.dtype == torch.float32
    # Random weights give ~log(vocab) = 6.6; the trained model is far below that.
    loss = demo.corpus_loss(model, path)
    assert loss < 0.3 * math.log(len(tok)), loss

    prompt = tok("Once upon a time").input_ids
    ids, _ = hf_greedy(path, prompt, 30)
    text = tok.decode(ids, skip_special_tokens=True)
    letters = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    assert len(text) > 40 and letters / len(text) > 0.85, text
    words = [w.strip(".,!?\"") for w in text.split()]
    vocab = set(w.strip(".,!?\"") for w in demo.CORPUS.split())
    assert sum(w in vocab for w in words) / len(words) > 0.6, text


def test_demo_model_path_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed build leaves nothing behind; a half folder (no config.json) gets replaced."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    calls: list[Path] = []

    def broken(save_dir: Path) -> Path:
        (Path(save_dir) / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "build_demo_model", broken)
    with pytest.raises(KeyboardInterrupt):
        demo.demo_model_path()
    assert [p.name for p in tmp_path.iterdir()] == [".demo-llama-v1.lock"]

    def fake(save_dir: Path) -> Path:
        calls.append(Path(save_dir))
        (Path(save_dir) / "config.json").write_text("{}")
        return Path(save_dir)

    half = tmp_path / "demo-llama-v1"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"partial")
    monkeypatch.setattr(demo, "build_demo_model", fake)
    path = demo.demo_model_path()
    assert path == half and (path / "config.json").is_file() and not (path / "model.safetensors").exists()
    assert demo.demo_model_path() == path and len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".demo-llama-v1.lock", "demo-llama-v1"]


def test_concurrent_callers_build_the_demo_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes asking for the demo model at once (two servers started together): while one builds, the
    other waits on the lock, then takes that build instead of making its own."""
    import fcntl
    import multiprocessing

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    ctx = multiprocessing.get_context("fork")
    events, release = ctx.Queue(), ctx.Event()
    real_flock = fcntl.flock

    def flock(fd, op):
        events.put("waits for the lock")
        return real_flock(fd, op)

    def build(save_dir: Path) -> Path:
        events.put("builds")
        assert release.wait(timeout=60)
        (Path(save_dir) / "config.json").write_text("{}")
        return Path(save_dir)

    monkeypatch.setattr(fcntl, "flock", flock)  # (the forked processes inherit both)
    monkeypatch.setattr(demo, "build_demo_model", build)
    first = ctx.Process(target=demo.demo_model_path)
    first.start()
    assert [events.get(timeout=60) for _ in range(2)] == ["waits for the lock", "builds"]
    second = ctx.Process(target=demo.demo_model_path)
    second.start()
    assert events.get(timeout=60) == "waits for the lock"  # it found no model, and the lock taken
    release.set()
    for p in (first, second):
        p.join(timeout=60)
        assert p.exitcode == 0
    assert events.empty() and (tmp_path / "demo-llama-v1" / "config.json").is_file()  # one build only


def test_the_demo_tokenizer_loads_by_its_served_name_offline(tmp_path, monkeypatch):
    """Load tools take the served name as a tokenizer to fetch from the hub: `pagedllm-demo` resolves from the
    Hugging Face cache (copied there by the demo build), offline, to the demo folder's own tokenizer."""
    import subprocess
    import sys

    from pagedllm.demo import demo_model_path

    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    folder = demo_model_path()
    assert (hub / "models--pagedllm-demo" / "refs" / "main").is_file()
    code = ("import sys; from transformers import AutoTokenizer; a = AutoTokenizer.from_pretrained('pagedllm-demo'); "
            "b = AutoTokenizer.from_pretrained(sys.argv[1]); t = 'Once upon a time'; "
            "assert a.encode(t) == b.encode(t) and len(a) == len(b), (a.encode(t), b.encode(t)); print('same')")
    env = {k: v for k, v in __import__("os").environ.items()}
    env.update({"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"})
    run = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, env=env,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 0 and "same" in run.stdout, run.stderr[-2000:]
