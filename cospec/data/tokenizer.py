"""A character-level tokenizer with special tokens, sized for the synthetic task suite.

Ids 0..3 are the specials: PAD (never attended: packing needs no padding, it only fills the tails of
right-padded batches), BOS (starts every prompt), EOS (ends every response), UNK. Then one id per
character of `ALPHABET`. The whole vocabulary fits in 64 ids so a small policy's embedding and head
stay cheap; `ModelConfig.vocab_size` must equal `CharTokenizer.vocab_size` (checked where a policy
meets a tokenizer, see `check_vocab`).
"""

from __future__ import annotations

import string

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
# digits, lower-case letters, and the punctuation the task prompts use
ALPHABET = string.digits + string.ascii_lowercase + " +-=:,>|()"


class CharTokenizer:
    pad_id, bos_id, eos_id, unk_id = PAD, BOS, EOS, UNK

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


def check_vocab(model_vocab_size: int, tokenizer: CharTokenizer) -> None:
    if model_vocab_size != tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={model_vocab_size} does not match the tokenizer's "
                         f"vocabulary of {tokenizer.vocab_size} tokens")
