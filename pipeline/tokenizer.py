"""Text tokenizer of a MiniCPM-o checkpoint (Qwen2-style byte-level BPE + added tokens).

Loads `tokenizer.json` with the `tokenizers` library, or builds the same tokenizer from
`vocab.json` + `merges.txt` + `added_tokens.json` when only those are shipped. No
transformers import on the serving path.

Special-token strings in text: `encode(text, special_tokens=True)` turns `<|im_end|>` typed
in the text into its id, as the reference tokenizes a rendered prompt; with False every
added token's string is plain text. The two modes are two Tokenizer instances built from
the same JSON, so concurrent callers never share a mutable flag.

`count(text, limit)` is `len(encode(text))` with an early stop, for refusing over-long
prompts without tokenizing all of them (see its docstring for why it stays exact).

`IncrementalDetokenizer` turns a growing list of ids into text deltas without ever
emitting half a UTF-8 character (byte-level BPE splits multi-byte characters).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
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


# count() encodes pieces of about this many characters.
COUNT_PIECE_CHARS = 8192

# Where count() may cut a text (see `TextTokenizer.count`): after a letter or digit that is
# ASCII, kana, a CJK ideograph or a Hangul syllable (ranges that are \p{L} since Unicode
# 2.0, so the regex library's Unicode version cannot matter), before ASCII whitespace or
# an ASCII / CJK punctuation mark: no match of QWEN2_SPLIT continues a letter or digit
# into one, and NFC composes nothing across one. With special tokens recognised only
# whitespace qualifies, because added tokens such as <|im_start|> contain letter +
# punctuation pairs.
_CUT_AFTER = r"[0-9A-Za-z\u3041-\u3094\u30a1-\u30fa\u4e00-\u9fa5\uac00-\ud7a3]"
_CUT_TEXT = re.compile(
    _CUT_AFTER + r"(?=[ \t\r\n!-/:-@\[-`{-~\u3001\u3002\uff01\uff0c\uff1a\uff1b\uff1f])"
)
_CUT_SPECIALS = re.compile(_CUT_AFTER + r"(?=[ \t\r\n])")

# Normalizers under which the cut rule and the bytes bound are proven, with the most a
# normalizer can shrink UTF-8 (NFC: 3, e.g. U+0390 = 6 bytes decomposed, 2 composed; or
# three 3-byte Hangul jamo composing into one 3-byte syllable).
_NORMALIZER_SHRINK = {None: 1, "NFC": 3}


def _is_qwen2_pre_tokenizer(pre: dict | None) -> bool:
    """Whether a tokenizer.json pre_tokenizer is `qwen2_pre_tokenizer()` in what decides the
    pieces (trim_offsets only moves offsets; the release has it false, ours true)."""
    if not pre or pre.get("type") != "Sequence" or len(pre.get("pretokenizers", [])) != 2:
        return False
    split, byte_level = pre["pretokenizers"]
    return (
        split.get("type") == "Split"
        and split.get("pattern") == {"Regex": QWEN2_SPLIT}
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("add_prefix_space")
        and not byte_level.get("use_regex")
    )


def _text_mode_copy(spec: dict) -> Tokenizer:
    """The tokenizer of `spec` (tokenizer.json contents) with every added token's string
    encoded as plain text.

    `encode_special_tokens` only covers tokens marked special, so every added token is
    marked special first (Qwen3 ships <think> as a non-special added token)."""
    spec = dict(spec, added_tokens=[dict(t, special=True) for t in spec.get("added_tokens", [])])
    plain = Tokenizer.from_str(json.dumps(spec))
    plain.encode_special_tokens = True
    return plain


class TextTokenizer:
    """encode(text) -> ids; decode(ids); count(text, limit) -> early-stopping len(encode).

    special_tokens (encode / count): True = special-token strings in the text become their
    ids (what the reference does); False = they are plain text (the Processor's default
    for client text, so typed control tokens cannot inject structure)."""

    def __init__(self, tokenizer: Tokenizer):
        spec = json.loads(tokenizer.to_str())
        self._tok = tokenizer
        self._plain = _text_mode_copy(spec)
        self.vocab = tokenizer.get_vocab(with_added_tokens=True)
        normalizer = spec.get("normalizer")
        norm_type = None if normalizer is None else normalizer.get("type")
        known = (
            _is_qwen2_pre_tokenizer(spec.get("pre_tokenizer")) and norm_type in _NORMALIZER_SHRINK
        )
        added = spec.get("added_tokens", [])
        # With specials recognised, a whitespace cut must not split an added token or the
        # whitespace an rstrip token swallows.
        specials_cuttable = not any(
            t.get("rstrip") or any(c.isspace() for c in t["content"]) for t in added
        )
        self._cut = {False: _CUT_TEXT if known else None,
                     True: _CUT_SPECIALS if known and specials_cuttable else None}
        self._bytes_per_token = self._max_token_bytes(spec) if known else None
        self._shrink = _NORMALIZER_SHRINK.get(norm_type, 1)
        # tokenizer_config.json's `bad_token_ids` (the reference tokenizer's attribute of that
        # name), set by from_dir: what the reference's streaming decode bans while speaking.
        self.bad_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer:
        tok = cls._from_dir(Path(path))
        config = Path(path) / "tokenizer_config.json"
        if config.is_file():
            bad = json.loads(config.read_text()).get("bad_token_ids") or ()
            tok.bad_token_ids = tuple(int(i) for i in bad)
        return tok

    @classmethod
    def _from_dir(cls, path: Path) -> TextTokenizer:
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

    @staticmethod
    def _max_token_bytes(spec: dict) -> int | None:
        """The most input bytes one token can stand for, or None when some byte has no
        token (then a byte could be dropped and the bound below would not hold)."""
        model = spec.get("model", {})
        if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            return None
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        vocab = model["vocab"]
        if not alphabet <= vocab.keys():
            return None
        # A byte-level entry spells one byte per character; an added token's raw string
        # (also placed in the vocabulary) stands for its UTF-8 bytes, or for what the
        # normalizer makes of them when it is matched after normalization (NFC: <= 3x).
        n = max(len(t) if set(t) <= alphabet else len(t.encode("utf-8")) for t in vocab)
        for t in spec.get("added_tokens", []):
            grows = t.get("normalized") and spec.get("normalizer") and not t["content"].isascii()
            n = max(n, len(t["content"].encode("utf-8")) * (3 if grows else 1))
        return n

    def _for(self, special_tokens: bool) -> Tokenizer:
        return self._tok if special_tokens else self._plain

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        return self._for(special_tokens).encode(text, add_special_tokens=False).ids

    def min_tokens(self, text: str) -> int:
        """A lower bound of len(encode(text)) from the UTF-8 length alone (0 = no bound).

        Every token of a byte-level BPE stands for at most `max bytes` bytes of the
        normalized text, and the normalizer shrinks the text at most by its factor (not at
        all for ASCII, which is NFC in every Unicode version)."""
        if self._bytes_per_token is None or not text:
            return 0
        if text.isascii():
            return math.ceil(len(text) / self._bytes_per_token)
        nbytes = len(text.encode("utf-8", errors="surrogatepass"))
        return math.ceil(nbytes / (self._bytes_per_token * self._shrink))

    def count(self, text: str, limit: int, *, special_tokens: bool = True) -> int:
        """len(encode(text)) when that is <= limit; otherwise some lower bound of it that
        is > limit, found without encoding much more than limit tokens' worth of text.

        First the bytes bound (`min_tokens`). Then the text is encoded in pieces of about
        COUNT_PIECE_CHARS, stopping once the running sum is over limit. The pieces add up
        exactly because each cut falls where the whole text's tokenization has a boundary
        too: after a letter or digit, before a character that starts a new pre-token of
        the Qwen2 split pattern whatever precedes it (whitespace, punctuation); none of its
        alternatives continues a letter/digit run into those, it has no lookbehind, and NFC
        composes nothing across them. Tokenizers without that pattern (or an unproven
        normalizer) are encoded whole."""
        bound = self.min_tokens(text)
        if bound > limit:
            return bound
        tok = self._for(special_tokens)
        n = 0
        for piece in self._pieces(text, self._cut[special_tokens]):
            n += len(tok.encode(piece, add_special_tokens=False).ids)
            if n > limit:
                return n
        return n

    @staticmethod
    def _pieces(text: str, cut: re.Pattern | None) -> Iterator[str]:
        start = 0
        if cut is not None:
            while len(text) - start > COUNT_PIECE_CHARS:
                m = cut.search(text, start + COUNT_PIECE_CHARS)
                if m is None:
                    break
                yield text[start : m.end()]
                start = m.end()
        yield text[start:]

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
