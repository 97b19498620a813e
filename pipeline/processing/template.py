"""ChatML prompt builder: messages with decoded media -> token ids + multimodal bounds.

Layout (MiniCPM-o 4.5 `tokenizer_config.json` chat template, spec 1.7):
    <|im_start|>{role}\n{content}<|im_end|>\n            per message
    <|im_start|>assistant\n                               generation prompt
      + <think>\n\n</think>\n\n                           when thinking is disabled (default)
      + <|tts_bos|>                                       with use_tts_template
The Processor always asks for <|tts_bos|>, text-only replies included: the reference's
streamed chat decodes after `<|im_end|>\n<|im_start|>assistant\n` + the think block +
`<|tts_bos|>` whether or not it speaks (`MiniCPMO.streaming_generate`'s `bos_input`,
`use_tts_template=True`, which the demo's chat server passes for text and speech alike).
The offline `chat()` rule (<|tts_bos|> only when some message holds audio) applies to its
HF `generate` path, not to the streamed one.
Content parts of a message are joined as the reference `MiniCPMO.chat()` joins them: with
"" in every message when the call is `omni_mode` (here: any message holds a video) or
`stream_input` (here: chunked audio placeholders), otherwise with "\n".

Placeholders (reference `get_slice_image_placeholder` / `get_audio_placeholder`):
    image: [<image_id>k</image_id>] <image> <unk>*64 </image>
           then per grid row: (<slice> <unk>*64 </slice>) * cols, rows joined by "\n"
    audio: <|audio_start|> <unk>*N <|audio_end|>, one group per clip, or one per 1 s chunk
           (N <= 10) when chunked

Ids are built piecewise: text runs go through `tokenizer.encode` (adjacent text is merged
first, so the split points are exactly the special tokens, as when the reference tokenizes
the whole string), special tokens and <unk> runs are inserted as ids. Whether a special
token's string typed inside a text run becomes that token is the encode function's choice
(the Processor encodes them as plain text unless told otherwise).

`count_prompt_tokens` walks the same layout without building it: the same text runs go to
an early-stopping counter, media not decoded yet are `MediaStub`s counted at their minimum,
so a request over the token limit is refused before its text is tokenized or media decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pipeline.config import SpecialTokens
from pipeline.handoff import AudioInput, ImageInput
from pipeline.processing.audio import chunk_token_counts
from pipeline.processing.errors import InvalidMessageError
from pipeline.processing.image import ProcessedImage

ROLES = ("system", "user", "assistant")

# Tokens the reference's streaming decode never samples while it speaks
# (`ChunkPrefillChunkGenerate.forbidden_tokens`, MiniCPM-o 4.5 `utils.py`): marks a voice
# cannot say. Looked up as `tokenizer.convert_tokens_to_ids` does, as raw vocabulary
# strings: the full-width ones are not byte-level BPE strings, so they resolve to <unk>.
SPOKEN_FORBIDDEN_TOKENS = (
    ":", "：", "；", "#", "“", "”", "‘", "’", "@", "*", "【", "】", "「", "」",
    "(", ")", "（", "）", "[", "]", "&", "/", "$",
)  # fmt: skip


def spoken_banned_ids(
    vocab: Mapping[str, int], unk_id: int, bad_token_ids: Iterable[int] = ()
) -> tuple[int, ...]:
    """The ids the reference bans at every step of a spoken reply, sorted: each of
    SPOKEN_FORBIDDEN_TOKENS' vocabulary id (<unk> when it has none), plus the tokenizer's
    `bad_token_ids` (tokenizer_config.json). The demo's chat server bans them only when it
    generates audio (`suppress_forbidden_tokens=generate_audio`), the Processor likewise."""
    ids = {vocab.get(t, unk_id) for t in SPOKEN_FORBIDDEN_TOKENS}
    ids.update(int(i) for i in bad_token_ids)
    return tuple(sorted(ids))


# ---------------------------------------------------------------------------------------
# Decoded content parts


@dataclass
class TextPart:
    text: str


@dataclass
class ImagePart:
    """An image (all its slices) or a video frame (use_image_id False, one slice)."""

    image: ProcessedImage
    use_image_id: bool = True


@dataclass
class AudioPart:
    """Tokens [first_token, first_token + num_tokens) of `clip`'s pooled embeddings.

    Several parts may share one clip (omni packing with a merged audio track); the builder
    stores each clip once.
    """

    clip: AudioInput
    num_tokens: int
    first_token: int = 0
    chunked: bool = False  # one <|audio_start|>..<|audio_end|> group per 1 s chunk


@dataclass
class OmniPart:
    """Interleaved frame / audio parts of one video, joined without separators."""

    parts: list[ImagePart | AudioPart]


@dataclass
class MediaStub:
    """A media part before decoding, for `count_prompt_tokens`: its placeholder has at least
    `min_tokens` tokens. Every placeholder starts and ends with a special token, so a stub
    splits the text runs exactly where the decoded part will."""

    kind: str  # "image" | "audio" | "video"
    min_tokens: int


Part = TextPart | ImagePart | AudioPart | OmniPart


@dataclass
class Message:
    role: str
    content: str | list[Part]


@dataclass
class Prompt:
    """The fields of a ThinkerRequest that the prompt determines (see handoff.py)."""

    input_ids: list[int] = field(default_factory=list)
    images: list[ImageInput] = field(default_factory=list)
    image_bounds: list[tuple[int, int]] = field(default_factory=list)
    audios: list[AudioInput] = field(default_factory=list)
    audio_bounds: list[tuple[int, int]] = field(default_factory=list)
    audio_segments: list[tuple[int, int, int]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------
# Builder


class PromptBuilder:
    """Appends text, special tokens and placeholders, recording bounds as it goes."""

    def __init__(self, tokens: SpecialTokens, encode: Callable[[str], list[int]], query_num: int):
        self.tokens = tokens
        self.encode = encode
        self.query_num = query_num
        self.out = Prompt()
        self._text: list[str] = []
        self._clip_index: dict[int, int] = {}  # id(AudioInput) -> index in out.audios
        self._image_id = 0

    def text(self, s: str) -> None:
        if s:
            self._text.append(s)

    def special(self, token_id: int) -> None:
        self._flush()
        self.out.input_ids.append(token_id)

    def _flush(self) -> None:
        if self._text:
            self.out.input_ids.extend(self.encode("".join(self._text)))
            self._text = []

    def _unk_run(self, n: int) -> tuple[int, int]:
        """n <unk> slots; returns (index of the first, index after the last)."""
        self._flush()
        start = len(self.out.input_ids)
        self.out.input_ids.extend([self.tokens.unk] * n)
        return start, start + n

    def image(self, part: ImagePart) -> None:
        t = self.tokens
        if part.use_image_id:
            self.special(t.image_id)
            self.text(str(self._image_id))
            self.special(t.image_id_end)
            self._image_id += 1
        self.special(t.image)
        self.out.image_bounds.append(self._unk_run(self.query_num))
        self.special(t.image_end)
        if part.image.grid is not None:
            cols, rows = part.image.grid
            for r in range(rows):
                if r > 0:
                    self.text("\n")
                for _ in range(cols):
                    self.special(t.slice)
                    self.out.image_bounds.append(self._unk_run(self.query_num))
                    self.special(t.slice_end)
        self.out.images.append(part.image.image)

    def audio(self, part: AudioPart) -> None:
        key = id(part.clip)
        if key not in self._clip_index:
            self._clip_index[key] = len(self.out.audios)
            self.out.audios.append(part.clip)
        clip = self._clip_index[key]
        counts = chunk_token_counts(part.num_tokens) if part.chunked else [part.num_tokens]
        first = part.first_token
        for n in counts:
            self.special(self.tokens.audio_start)
            self.out.audio_bounds.append(self._unk_run(n))
            self.out.audio_segments.append((clip, first, n))
            first += n
            self.special(self.tokens.audio_end)

    def parts(self, parts: list[Part | MediaStub], sep: str) -> None:
        for i, p in enumerate(parts):
            if i > 0:
                self.text(sep)
            if isinstance(p, TextPart):
                self.text(p.text)
            elif isinstance(p, ImagePart):
                self.image(p)
            elif isinstance(p, AudioPart):
                self.audio(p)
            elif isinstance(p, OmniPart):
                self.parts(p.parts, "")
            elif isinstance(p, MediaStub):
                self.stub(p)
            else:
                raise InvalidMessageError(f"unknown content part type {type(p).__name__}")

    def stub(self, part: MediaStub) -> None:
        raise TypeError(f"a {part.kind} part must be decoded before its prompt is built")

    def finish(self) -> Prompt:
        self._flush()
        return self.out


class _OverLimit(Exception):
    pass


class PromptCounter(PromptBuilder):
    """Counts what PromptBuilder would emit, and stops once the count is over `limit`.

    Text runs are the builder's own (same merging), each counted by `count(text, budget)`,
    which is exact up to the budget; special tokens count 1, <unk> runs their length,
    MediaStubs their minimum."""

    def __init__(
        self, tokens: SpecialTokens, count: Callable[[str, int], int], query_num: int, limit: int
    ):
        super().__init__(tokens, _no_encode, query_num)
        self.count = count
        self.limit = limit
        self.n = 0

    def _add(self, n: int) -> None:
        self.n += n
        if self.n > self.limit:
            raise _OverLimit

    def special(self, token_id: int) -> None:
        self._flush()
        self._add(1)

    def _flush(self) -> None:
        if self._text:
            text, self._text = "".join(self._text), []
            self._add(self.count(text, self.limit - self.n))

    def _unk_run(self, n: int) -> tuple[int, int]:
        self._flush()
        self._add(n)
        return 0, 0

    def stub(self, part: MediaStub) -> None:
        self._flush()
        self._add(part.min_tokens)


def _no_encode(text: str) -> list[int]:
    raise AssertionError("PromptCounter counts text runs, it never encodes them")


def _split_reasoning(content: str) -> tuple[str, str]:
    """(reasoning, answer) of an assistant message, as the chat template splits it."""
    if "</think>" not in content:
        return "", content
    head, answer = content.rsplit("</think>", 1)
    reasoning = head.rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, answer.lstrip("\n")


def build_prompt(
    messages: list[Message],
    tokens: SpecialTokens,
    encode: Callable[[str], list[int]],
    *,
    query_num: int = 64,
    enable_thinking: bool = False,
    use_tts_template: bool = False,
    add_generation_prompt: bool = True,
    stream_input: bool = False,
) -> Prompt:
    """Render messages (system / user / assistant) to ids and bounds; see module docstring.
    stream_input: the reference's `chat(stream_input=True)` layout (content parts joined
    with ""), which goes with chunked audio placeholders."""
    b = PromptBuilder(tokens, encode, query_num)
    _render(
        b, messages, tokens, enable_thinking, use_tts_template, add_generation_prompt, stream_input
    )
    return b.finish()


def count_prompt_tokens(
    messages: list[Message],
    tokens: SpecialTokens,
    count: Callable[[str, int], int],
    *,
    limit: int,
    query_num: int = 64,
    enable_thinking: bool = False,
    use_tts_template: bool = False,
    add_generation_prompt: bool = True,
    stream_input: bool = False,
) -> int:
    """What len(build_prompt(...).input_ids) would be, when that is <= limit; otherwise a
    number > limit, found without counting past it. `count(text, budget)` must be exact
    up to budget and a lower bound beyond it (TextTokenizer.count). With MediaStubs in the
    messages the result is a lower bound, so `result > limit` is a safe refusal."""
    b = PromptCounter(tokens, count, query_num, limit)
    try:
        _render(
            b,
            messages,
            tokens,
            enable_thinking,
            use_tts_template,
            add_generation_prompt,
            stream_input,
        )
        b.finish()
    except _OverLimit:
        pass
    return b.n


def _is_omni(p: Part | MediaStub) -> bool:
    return isinstance(p, OmniPart) or (isinstance(p, MediaStub) and p.kind == "video")


def _render(
    b: PromptBuilder,
    messages: list[Message],
    tokens: SpecialTokens,
    enable_thinking: bool,
    use_tts_template: bool,
    add_generation_prompt: bool,
    stream_input: bool,
) -> None:
    if not messages:
        raise InvalidMessageError("messages is empty")
    # The reference decides the joiner once per call (`"".join` under omni_mode or
    # stream_input, else `"\n".join`), so one video makes every message's parts adjacent.
    omni = any(_is_omni(p) for m in messages if not isinstance(m.content, str) for p in m.content)
    sep = "" if stream_input or omni else "\n"
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidMessageError(f"message {i}: role {m.role!r} is not one of {ROLES}")
        b.special(tokens.im_start)
        b.text(f"{m.role}\n")
        if isinstance(m.content, str):
            content = m.content
            if m.role == "assistant":
                # History turns lose their reasoning; a turn after the last user message keeps
                # an (empty or real) think block, as the chat template renders it.
                reasoning, content = _split_reasoning(content)
                if i > last_user and (i == len(messages) - 1 or reasoning):
                    b.special(tokens.think)
                    b.text("\n" + reasoning.strip("\n") + "\n")
                    b.special(tokens.think_end)
                    b.text("\n\n")
            b.text(content)
        else:
            b.parts(m.content, sep)
        b.special(tokens.im_end)
        b.text("\n")
    if add_generation_prompt:
        b.special(tokens.im_start)
        b.text("assistant\n")
        if not enable_thinking:
            b.special(tokens.think)
            b.text("\n\n")
            b.special(tokens.think_end)
            b.text("\n\n")
        if use_tts_template:
            b.special(tokens.tts_bos)
