"""Text tokenizer of a MiniCPM-o checkpoint (Qwen2-style byte-level BPE + added tokens).

Loads `tokenizer.json` with the `tokenizers` library, or builds the same tokenizer from
`vocab.json` + `merges.txt` + `added_tokens.json` when only those are shipped. No
transformers import on the serving path.

`IncrementalDetokenizer` turns a growing list of ids into text deltas without ever
emitting half a UTF-8 character (byte-level BPE splits multi-byte characters).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

# Qwen2's pre-tokenizer split pattern.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def qwen2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class TextTokenizer:
    """encode(text) -> ids (special tokens in the text are recognised); decode(ids)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self.vocab = tokenizer.get_vocab(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> "TextTokenizer":
        path = Path(path)
        tj = path / "tokenizer.json"
        if tj.is_file():
            return cls(Tokenizer.from_file(str(tj)))
        vocab, merges = path / "vocab.json", path / "merges.txt"
        if not (vocab.is_file() and merges.is_file()):
            raise FileNotFoundError(
                f"{path}: no tokenizer found (need tokenizer.json, or vocab.json + merges.txt)"
            )
        # Added tokens: added_tokens.json, plus tokenizer_config.json's added_tokens_decoder
        # (the only place the released files list `<unk>`, id 128244, inside the BPE range).
        added: dict[str, int] = {}
        if (path / "added_tokens.json").is_file():
            added.update(json.loads((path / "added_tokens.json").read_text()))
        if (path / "tokenizer_config.json").is_file():
            decoder = json.loads((path / "tokenizer_config.json").read_text()).get("added_tokens_decoder", {})
            added.update({v["content"]: int(k) for k, v in decoder.items()})
        # Put each added token into the BPE vocabulary at its id (replacing whatever held
        # that id), so the tokenizers library keeps the id instead of appending it.
        vocab_map: dict[str, int] = json.loads(vocab.read_text())
        taken = {i: t for t, i in vocab_map.items()}
        for text, i in added.items():
            if i in taken and taken[i] != text:
                del vocab_map[taken[i]]
            vocab_map[text] = i
        lines = [ln for ln in merges.read_text(encoding="utf-8").splitlines() if ln and not ln.startswith("#version")]
        merge_pairs = [tuple(ln.split(" ")) for ln in lines]
        tok = Tokenizer(models.BPE(vocab=vocab_map, merges=merge_pairs))
        tok.pre_tokenizer = qwen2_pre_tokenizer()
        tok.decoder = decoders.ByteLevel()
        from tokenizers import AddedToken

        items = sorted(added.items(), key=lambda kv: kv[1])
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in items])
        wrong = {t: i for t, i in added.items() if tok.token_to_id(t) != i}
        if wrong:
            raise ValueError(f"{path}: added tokens did not get their ids: {dict(list(wrong.items())[:5])}")
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int:
        if text not in self.vocab:
            raise KeyError(f"token {text!r} not in vocabulary")
        return self.vocab[text]


class IncrementalDetokenizer:
    """Emits text deltas for a growing id sequence.

    Decodes a short window of recent ids and emits only the new suffix; a trailing
    U+FFFD (an incomplete UTF-8 sequence) is held back until the next id completes it.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window that gives context
        self.read_offset = 0  # ids before this are already emitted

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back (possibly a replacement char) at the end."""
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
