"""Tokenizers: the seam (`Tokenizer`), the character-level tokenizer of the embedded default
(`CharTokenizer`), and a pretrained checkpoint's own (`HFTokenizer`: HF files or GGUF metadata,
through transformers).

Character tokenizer: ids 0..3 are the specials PAD, BOS (starts every prompt), EOS (ends every
response), UNK; then one id per character of `ALPHABET`. The whole vocabulary fits in 64 ids so a
small policy's embedding and head stay cheap; `ModelConfig.vocab_size` must equal
`CharTokenizer.vocab_size` for the embedded policy.

`PAD` (id 0) is also what rollout, draft and parallel code fill right-padded tensors with, whatever
the tokenizer: those positions are never attended and never trained, so any valid id serves.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Protocol, runtime_checkable

from cospec.config import ConfigError

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
# digits, lower-case letters, and the punctuation the task prompts use
ALPHABET = string.digits + string.ascii_lowercase + " +-=:,>|()"


class CharTokenizer:
    pad_id, bos_id, eos_id, unk_id = PAD, BOS, EOS, UNK
    stop_ids = (EOS,)
    has_chat_template = False

    def __init__(self, alphabet: str = ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("tokenizer alphabet has repeated characters")
        self.alphabet = alphabet
        self._id = {c: i + len(SPECIALS) for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.alphabet)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = [self._id.get(c, UNK) for c in text]
        return ([BOS] if bos else []) + ids + ([EOS] if eos else [])

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == EOS and stop_at_eos:
                break
            if i >= len(SPECIALS):
                out.append(self.alphabet[i - len(SPECIALS)])
        return "".join(out)

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        raise ValueError("the character tokenizer has no chat template (task.chat_template=false)")


# ----------------------------------------------------------------------------- the seam

@runtime_checkable
class Tokenizer(Protocol):
    """What cospec needs of a tokenizer; `CharTokenizer` and `HFTokenizer` implement it.

    vocab_size: ids the tokenizer can produce (a model's embedding may be larger: padded ids are
    never sampled). stop_ids: every id that ends a response (EOS and a chat template's end-of-turn
    token). pad_id: an id to fill right-padded tensors with (never attended, never a target).
    Example (SmolLM2-135M-Instruct): vocab_size 49152, bos_id 1 (<|im_start|>), eos_id 2
    (<|im_end|>), stop_ids (0, 2) (<|endoftext|> and <|im_end|>).
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]
    has_chat_template: bool

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids, *, stop_at_eos: bool = True) -> str: ...

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]: ...


# ids that end a chat model's turn in the common templates (ChatML, Llama 3, Phi, GPT-2 style)
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>")


class HFTokenizer:
    """A checkpoint's own tokenizer through transformers (fast tokenizers; no hand-written BPE).

    Built from an HF directory (tokenizer.json / tokenizer_config.json, generation_config.json for
    extra EOS ids) or from a GGUF file's metadata (transformers converts llama.cpp's token list and
    merges). The chat template is the checkpoint's; prompts are rendered by it to text and then
    encoded without adding specials again (the template writes its own).
    """

    def __init__(self, hf_tokenizer, *, extra_stop_ids: tuple[int, ...] = (), source: str = ""):
        self.hf = hf_tokenizer
        self.source = source
        self.vocab_size = len(hf_tokenizer)
        self.bos_id = hf_tokenizer.bos_token_id
        eos = hf_tokenizer.eos_token_id
        vocab = hf_tokenizer.get_vocab()
        stops = {i for i in (eos, *extra_stop_ids) if i is not None}
        stops |= {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
        if not stops:
            raise ValueError(f"tokenizer of {source or 'the checkpoint'}: no EOS or end-of-turn token; "
                             f"a response could never end")
        self.eos_id = eos if eos is not None else min(stops)
        self.stop_ids = tuple(sorted(stops))
        pad = hf_tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_id
        self.has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "HFTokenizer":
        """The tokenizer of an HF checkpoint directory or a .gguf file (offline, local files only)."""
        from transformers import AutoTokenizer

        path = Path(path)
        try:
            if path.suffix == ".gguf":
                hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                                   local_files_only=True)
            else:
                hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: no usable tokenizer ({type(e).__name__}: {e})") from e
        extra: tuple[int, ...] = ()
        gen = path / "generation_config.json"
        if path.is_dir() and gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            extra = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(hf, extra_stop_ids=extra, source=str(path))

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False)
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + ids + ([self.eos_id] if eos else [])

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        ids = [int(i) for i in ids]
        if stop_at_eos:
            for n, i in enumerate(ids):
                if i in self.stop_ids:
                    ids = ids[:n]
                    break
        return self.hf.decode(ids, skip_special_tokens=True)

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            raise ValueError(f"tokenizer of {self.source or 'the checkpoint'} has no chat template "
                             f"(set task.chat_template=false to feed plain prompts)")
        text = self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        return self.hf.encode(text, add_special_tokens=False)


def check_vocab(model_vocab_size: int, tokenizer: Tokenizer) -> None:
    """ConfigError unless the model can embed every id the tokenizer makes (a larger, padded
    embedding is fine: `Transformer.sampled_vocab_size` keeps its extra ids out of sampling)."""
    if model_vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's "
                         f"vocabulary of {tokenizer.vocab_size} tokens")
