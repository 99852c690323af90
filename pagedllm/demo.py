"""Built-in demo model: a tiny Llama trained for a few seconds on an embedded corpus.

The engine needs a real checkpoint to run end to end (CLI, server, examples, tests) but the
environment has no network access. This module builds one from scratch, deterministically:
a byte-level BPE tokenizer trained on a short embedded corpus and a small ``LlamaForCausalLM``
trained briefly on the same text, so that greedy decoding yields English-looking words instead
of random junk. The result is an ordinary Hugging Face model folder.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"
# Order fixes the ids: specials come first, so bos=0, eos=1, pad=2, ... in every tokenizer built here.
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    START_HEADER_TOKEN,
    END_HEADER_TOKEN,
    EOT_TOKEN,
)

MODEL_MAX_LENGTH = 2048
DEMO_VOCAB_SIZE = 2048
DEMO_MODEL_NAME = "demo-llama-v1"
DEMO_SERVED_NAME = "pagedllm-demo"  # what `pagedllm serve` with no model serves it as
# Bump DEMO_MODEL_NAME whenever the corpus, tokenizer, config or training recipe changes,
# so stale caches are never reused.

# Llama-3 style template: bos, then one header block per message closed by <|eot_id|>.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] | trim }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Original prose written for this project (no third-party text), released into the public domain.
CORPUS = """\
Once upon a time there was a little village by the sea. The people of the village were fishers and farmers, and every morning they walked down to the water to see what the tide had brought. The houses were small and white, and the roofs were red. A long road ran from the hills to the harbour, and children played along it all day.

Once upon a time there was a girl named Anna who lived in the village with her grandmother. Anna liked to read books and to watch the boats. Her grandmother told her stories about the old days, when the sea was wild and the winters were long. Anna listened to every word and kept the stories in her heart.

One day Anna found a small blue bird on the road. The bird could not fly, because one of its wings was hurt. Anna carried the bird home in her hands. Her grandmother gave her a warm cloth and a little water, and together they made a bed for the bird in a wooden box. Every day Anna gave the bird seeds and water, and every day the bird grew a little stronger.

After many days the bird stood on the edge of the box and opened its wings. Anna took the box to the garden and waited. The bird looked at her, sang a short song, and flew up into the blue sky. Anna was sad for a moment, but then she smiled, because the bird was free and happy.

Once upon a time there was a young man named Tom who wanted to see the world. He lived in a quiet town in the hills, where nothing ever changed. One spring morning he packed a bag with bread, cheese and a warm coat, and he walked down the long road to the sea. He met a farmer, a baker and an old sailor on the way, and each of them gave him good advice.

The farmer said, "Work hard and the land will feed you." The baker said, "Share your bread and you will never be alone." The old sailor said, "Watch the sky and the sea will not surprise you." Tom thanked them all and kept walking until he reached the harbour, where a great ship was waiting.

Tom worked on the ship for many years. He learned to tie ropes, to read the stars and to mend the sails. He saw cities of stone and gold, forests full of strange birds, and islands where the sand was as white as snow. But every night he thought about his quiet town in the hills, and about his mother and his friends.

At last Tom came home. The town was the same as before, but Tom was not the same. He told the children about the ships and the stars, and they listened with wide eyes. He planted a garden, baked bread for his neighbours, and watched the sky every evening. He had learned that the world is large, and that home is a good place to return to.

Once upon a time there was a cat who lived in a library. The cat slept on the warm books during the day and walked between the shelves at night. The people who came to read liked the cat, and they gave it a name: Page. Page knew every corner of the library, every chair and every window.

One winter night the lights went out in the library. A little boy was still there, reading in a corner, and he was afraid of the dark. Page walked to the boy and sat beside him. The boy put his hand on the soft fur of the cat, and he was not afraid any more. When the lights came back, the boy laughed and said, "Thank you, Page."

The sun rises in the east and sets in the west. In the morning the sky is pale and clear, at noon it is bright and blue, and in the evening it turns red and gold. At night the moon and the stars come out, and the world is quiet. The seasons change through the year: spring brings flowers, summer brings heat, autumn brings rain and falling leaves, and winter brings cold and snow.

The river runs from the mountains to the sea. It begins as a small stream of cold water between the rocks, and it grows as other streams join it. It turns mills, waters fields and carries boats. Fish swim in it, birds drink from it, and children swim in it on summer days. In the end the river reaches the sea and becomes part of something much larger.

A good friend is kind and honest. A good friend listens when you speak, helps when you are in trouble, and tells you the truth even when it is hard to hear. Friends share food, time and stories. They laugh together on good days and stay together on bad days. It is a fine thing to have a good friend, and a finer thing to be one.

Once upon a time there was an old clock maker who lived in a narrow street in the city. His shop was full of clocks of every size, and they all ticked together like a small orchestra. Every morning he opened the door, wound the clocks, and sat down at his table to work. He fixed clocks for the baker, the teacher and the mayor, and he never asked for more than a fair price.

One day a little girl brought him a broken watch. It had belonged to her father, and it had stopped on the day he went away to sea. The clock maker opened the watch and looked at the small wheels for a long time. He cleaned them, he oiled them, and he set them right. When the watch began to tick again, the girl held it to her ear and smiled. A week later her father came home.

The garden behind the house was small, but it was full of life. There were tomatoes and beans, apples and pears, and a row of tall yellow flowers that turned their faces to the sun. Bees flew from flower to flower, and a small brown dog slept in the shade of the apple tree. In the evening the family sat in the garden, ate their supper, and talked about the day.

Questions and answers. What is the capital of France? The capital of France is Paris. What colour is the sky on a clear day? The sky is blue. How many days are there in a week? There are seven days in a week. What do bees make? Bees make honey. Where do fish live? Fish live in the water. What do we use to write? We use a pen or a pencil to write.

Once upon a time there was a small dragon who did not like fire. The other dragons laughed at him, because he could only blow warm air and little clouds of smoke. The small dragon was sad and flew away to the mountains. There he met a family of farmers whose bread would not rise in the cold. The small dragon blew his warm air over the bread, and the bread rose high and golden. The farmers were very happy, and the small dragon stayed with them for the rest of his life.

The end. Thank you for reading. The story is over, and it is time to sleep. Good night, and sweet dreams.
"""


def build_tokenizer(save_dir: str | Path, vocab_size: int = DEMO_VOCAB_SIZE) -> None:
    """Train a byte-level BPE tokenizer on the embedded corpus and save it as an HF tokenizer.

    Byte-level pre-tokenization and decoding mean any UTF-8 text round-trips, even characters
    that never occur in the corpus. A TemplateProcessing post-processor prepends bos when
    ``add_special_tokens=True``, which is how Llama-3 tokenizers behave.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    tokenizer.save(str(save_dir / "tokenizer.json"))

    added_tokens_decoder = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "model_input_names": ["input_ids", "attention_mask"],
        "added_tokens_decoder": added_tokens_decoder,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
    }
    _write_json(save_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(save_dir / "special_tokens_map.json", special_tokens_map)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _tokenizer_info(tokenizer_dir: Path) -> tuple[int, int, int, int]:
    """Return (vocab_size, bos_id, eos_id, pad_id) of a tokenizer written by build_tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return (
        tok.get_vocab_size(with_added_tokens=True),
        tok.token_to_id(BOS_TOKEN),
        tok.token_to_id(EOS_TOKEN),
        tok.token_to_id(PAD_TOKEN),
    )


def _make_demo_config() -> dict[str, Any]:
    """Config for the demo Llama. Vocab and special ids come from the (deterministic) tokenizer."""
    with tempfile.TemporaryDirectory(prefix="pagedllm-tok-") as tmp:
        build_tokenizer(tmp, DEMO_VOCAB_SIZE)
        vocab_size, bos_id, eos_id, pad_id = _tokenizer_info(Path(tmp))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }


DEMO_CONFIG: dict[str, Any] = _make_demo_config()

# Training recipe (~123k training tokens, ~65 passes over the 1.9k-token corpus). On 2 idle CPU
# cores this takes ~20 s and reaches a corpus loss of ~0.5 (random init: ~6.6); fewer steps
# leave visibly garbled text.
TRAIN_SEED = 0
TRAIN_STEPS = 120
TRAIN_SEQ_LEN = 128
TRAIN_BATCH_SIZE = 8
TRAIN_LR = 3e-3


def _corpus_token_ids(tokenizer_dir: Path) -> list[int]:
    """Corpus as one token stream: each paragraph starts with bos and ends with eos."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos_id = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for para in CORPUS.split("\n\n"):
        para = para.strip()
        if para:
            ids.extend(tok.encode(para, add_special_tokens=True).ids)
            ids.append(eos_id)
    return ids


def corpus_loss(model: Any, tokenizer_dir: str | Path, seq_len: int = TRAIN_SEQ_LEN) -> float:
    """Mean next-token loss of ``model`` on the embedded corpus (used to check training worked)."""
    import torch

    ids = torch.tensor(_corpus_token_ids(Path(tokenizer_dir)), dtype=torch.long)
    n = (len(ids) - 1) // seq_len * seq_len
    inputs = ids[:n].view(-1, seq_len)
    labels = ids[1 : n + 1].view(-1, seq_len)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
    return float(loss)


def _to_hf_config_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}


def _train(model: Any, token_ids: list[int]) -> float:
    """Briefly train on random windows of the corpus; deterministic given the seed. Returns last loss."""
    import torch

    gen = torch.Generator().manual_seed(TRAIN_SEED)
    data = torch.tensor(token_ids, dtype=torch.long)
    max_start = len(data) - TRAIN_SEQ_LEN - 1
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * max(0.1, 1.0 - s / TRAIN_STEPS)
    )
    model.train()
    loss_val = float("nan")
    for _ in range(TRAIN_STEPS):
        starts = torch.randint(0, max_start + 1, (TRAIN_BATCH_SIZE,), generator=gen)
        batch = torch.stack([data[s : s + TRAIN_SEQ_LEN + 1] for s in starts.tolist()])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_val = loss.detach().item()
    model.eval()
    return loss_val


def build_demo_model(save_dir: str | Path) -> Path:
    """Write a complete HF model folder (config, generation config, safetensors, tokenizer)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(save_dir, DEMO_VOCAB_SIZE)
    vocab_size, bos_id, eos_id, _ = _tokenizer_info(save_dir)
    if (vocab_size, bos_id, eos_id) != (
        DEMO_CONFIG["vocab_size"],
        DEMO_CONFIG["bos_token_id"],
        DEMO_CONFIG["eos_token_id"],
    ):
        raise RuntimeError("demo tokenizer is not deterministic: vocab or special ids changed")

    start = time.perf_counter()
    torch.manual_seed(TRAIN_SEED)
    config = LlamaConfig(**_to_hf_config_kwargs(DEMO_CONFIG))
    model = LlamaForCausalLM(config).to(torch.float32)
    loss = _train(model, _corpus_token_ids(save_dir))
    logger.info("trained demo model in %.1f s (final loss %.3f)", time.perf_counter() - start, loss)

    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=DEMO_CONFIG["pad_token_id"]
    )
    model.save_pretrained(save_dir, safe_serialization=True)
    _rewrite_config_json(save_dir / "config.json", DEMO_CONFIG)
    if not (save_dir / "model.safetensors").is_file():
        raise RuntimeError(f"save_pretrained did not write {save_dir / 'model.safetensors'}")
    return save_dir


def _rewrite_config_json(path: Path, config: dict[str, Any]) -> None:
    """Make config.json look like a typical hub checkpoint (``rope_theta`` + ``rope_scaling``).

    transformers 5 writes a ``rope_parameters`` dict instead; most published checkpoints (and
    inference engines) use the older keys, and transformers still reads them.
    """
    saved = json.loads(path.read_text(encoding="utf-8"))
    saved.pop("rope_parameters", None)
    saved.pop("dtype", None)
    saved.update(config)
    _write_json(path, saved)


def _cache_root() -> Path:
    env = os.environ.get("PAGEDLLM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pagedllm"


def demo_model_path() -> Path:
    """Return the cached demo model folder, building it on first use.

    The build goes to a temporary sibling folder that is renamed into place when complete, so
    an interrupted build never leaves a half-written model behind; concurrent callers build once (a lock
    file beside the model).
    """
    final = _cache_root() / DEMO_MODEL_NAME
    if not (final / "config.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        # One build at a time: a process that finds another building (two servers started at once on a fresh
        # machine) waits for it and uses its build instead of training a second copy.
        with open(final.parent / f".{DEMO_MODEL_NAME}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (final / "config.json").is_file():
                _build_into(final)
    register_in_hub_cache(final)
    return final


# What a tokenizer load reads of the demo folder (not the weights).
_TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json")


def register_in_hub_cache(folder: Path) -> Path | None:
    """Make `AutoTokenizer.from_pretrained("pagedllm-demo")` find the demo's tokenizer with no network: load tools
    (guidellm, benchmark clients) take the served model's name as a tokenizer to fetch from the hub, and the
    demo's name is no hub repository. The folder's tokenizer files are copied into the Hugging Face cache as the
    repository `pagedllm-demo` (one snapshot, whose revision is the files' hash), which the hub client reads when
    HF_HUB_OFFLINE=1 or the hub cannot be reached. Returns the snapshot folder, or None where the cache is not
    writable (nothing else depends on it)."""
    import hashlib

    try:
        from huggingface_hub import constants

        files = [folder / name for name in _TOKENIZER_FILES if (folder / name).is_file()]
        if not all((folder / name).is_file() for name in ("config.json", "tokenizer.json", "tokenizer_config.json")):
            return None  # not a whole demo folder (nothing to load a tokenizer from)
        revision = hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()
        repo = Path(constants.HF_HUB_CACHE) / f"models--{DEMO_SERVED_NAME}"
        snapshot = repo / "snapshots" / revision
        if (repo / "refs" / "main").is_file() and (repo / "refs" / "main").read_text() == revision \
                and all((snapshot / f.name).is_file() for f in files):
            return snapshot
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in files:  # copies (small files), each put in place whole: a link would dangle once the folder goes
            part = snapshot / f".{f.name}.{os.getpid()}"
            shutil.copyfile(f, part)
            os.replace(part, snapshot / f.name)
        (repo / "refs").mkdir(exist_ok=True)
        part = repo / "refs" / f".main.{os.getpid()}"
        part.write_text(revision)
        os.replace(part, repo / "refs" / "main")
        return snapshot
    except (ImportError, OSError) as e:
        logger.debug("the demo's tokenizer was not copied into the Hugging Face cache: %s", e)
        return None


def _build_into(final: Path) -> None:
    logger.info("building demo model into %s (one-time, ~30 s)", final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}-", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the finished cache folder should not be
    try:
        build_demo_model(tmp)
        if final.exists() and not (final / "config.json").is_file():
            # Not written by us (we only ever rename complete builds into place): clear it.
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process finished first (final exists and is non-empty): use its build.
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
