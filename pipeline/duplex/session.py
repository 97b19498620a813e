"""One full-duplex session: the Thinker's unit, then (on a speak unit) its speech chunk.

`DuplexSession.unit` is the reference's `streaming_prefill` + `streaming_generate` pair:
the unit's input is prefilled, the Thinker decides listen or speak and decodes the chunk's
tokens, and a speak unit's (id, hidden) rows go to the speech side, which keeps the
Talker's and Token2Wav's per-turn state and resets it at the turn's end. With no speech
side (text only) a speak unit carries its text and no audio. `DuplexSession.finish_units`
finishes the units of many sessions (pipeline/duplex/batch.py): their Talker chunks draw in
lockstep and their Token2Wav windows run batched (`pipeline.duplex.speech.speak_steps`),
each as alone; `finish_units_steps` is the same as a generator that yields after each GPU
step, for a batch that runs beside the Thinker engine's steps.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pipeline.duplex.thinker import DuplexThinker, ThinkerUnit
from pipeline.utils import drain


class SpeechSide(Protocol):
    """What the session needs of `pipeline.duplex.speech.DuplexSpeech`."""

    def prepare(self, prompt_wav: np.ndarray | str | None) -> None: ...

    def speak(self, spoken: list[tuple[int, torch.Tensor]], end_of_turn: bool): ...


@dataclass
class UnitResult:
    is_listen: bool
    end_of_turn: bool
    text: str
    token_ids: list[int]
    codes: list[int]
    pcm: np.ndarray | None
    prefill: list = field(default_factory=list)  # the unit's prefill schema (see ThinkerUnit)


class DuplexSession:
    def __init__(self, thinker: DuplexThinker, speech: SpeechSide | None = None):
        self.thinker = thinker
        self.speech = speech
        self.units = 0
        # The reference draws the Thinker's and the Talker's samples from one RNG, in unit
        # order: a speech side on the same device draws from the Thinker's generator too.
        gen = getattr(speech, "generator", None)
        if isinstance(gen, torch.Generator) and gen.device == thinker.generator.device:
            speech.generator = thinker.generator

    def prepare(self, prefix: str | None = None, suffix: str | None = None,
                ref_audio: np.ndarray | None = None,
                prompt_wav: np.ndarray | str | None = None) -> None:
        # the reference sets up the voice's Token2Wav cache before the prompt's prefill
        if self.speech is not None:
            self.speech.prepare(prompt_wav)
        self.thinker.prepare(prefix, suffix, ref_audio)
        self.units = 0

    def close(self) -> None:
        """Frees the session's state on both sides (the speech side's if it has `close`)."""
        self.thinker.close()
        close = getattr(self.speech, "close", None)
        if close is not None:
            close()

    def unit(self, audio: np.ndarray | None, frames: list | None = None,
             force: str | None = None, max_slice_nums: int | list[int] = 1) -> UnitResult:
        self.thinker.prefill_unit(audio, frames, max_slice_nums)
        return self.finish_unit(self.thinker.generate_unit(force))

    def finish_unit(self, tu: ThinkerUnit) -> UnitResult:
        """A unit after the Thinker's part: a speak unit's speech chunk, and its result."""
        (out,) = DuplexSession.finish_units([(self, tu)])
        if isinstance(out, BaseException):
            raise out
        return out

    @staticmethod
    def finish_units(
        items: list[tuple[DuplexSession, ThinkerUnit]],
    ) -> list[UnitResult | BaseException]:
        """`finish_unit` of several sessions (each once): `finish_units_steps` run to its
        end, with nothing between its steps."""
        return drain(DuplexSession.finish_units_steps(items))

    @staticmethod
    def finish_units_steps(
        items: list[tuple[DuplexSession, ThinkerUnit]],
    ) -> Generator[None, None, list[UnitResult | BaseException]]:
        """`finish_unit` of several sessions (each once), one GPU step a `next()`: the speak
        units whose speech side is a DuplexSpeech draw their Talker codes together
        (speech.speak_steps, each as alone); any other speech side speaks on its own.
        Returns per item its UnitResult or the exception that failed it."""
        chunks: dict[int, object] = {}
        batched = [i for i, (s, tu) in enumerate(items)
                   if not tu.is_listen and s.speech is not None]
        if batched:
            from pipeline.duplex.speech import DuplexSpeech, speak_steps

            batched = [i for i in batched if isinstance(items[i][0].speech, DuplexSpeech)]
            runs = [(items[i][0].speech, items[i][1].spoken, items[i][1].end_of_turn)
                    for i in batched]
            spoken = (yield from speak_steps(runs)) if runs else []
            chunks = dict(zip(batched, spoken, strict=True))
        out: list[UnitResult | BaseException] = []
        for i, (session, tu) in enumerate(items):
            session.units += 1
            codes: list[int] = []
            pcm: np.ndarray | None = None
            if not tu.is_listen and session.speech is not None:
                try:
                    chunk = chunks[i] if i in chunks else session.speech.speak(
                        tu.spoken, tu.end_of_turn)
                except Exception as e:  # noqa: BLE001 - this session's unit fails alone
                    chunk = e
                if isinstance(chunk, BaseException):
                    out.append(chunk)
                    continue
                codes = [int(c) for c in chunk.codes]
                pcm = chunk.pcm
            out.append(UnitResult(tu.is_listen, tu.end_of_turn, tu.text, tu.token_ids, codes,
                                  pcm, tu.prefill))
        return out
