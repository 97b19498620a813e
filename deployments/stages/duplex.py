"""Full-duplex sessions resident in the Thinker stage, over the engine's own model.

A session (pipeline.duplex.session.DuplexSession) keeps its Thinker state (KV, streaming
audio encoder, decisions) and its speech state (the Talker's per-turn KV, the Token2Wav
stream) between units. Its units run on the engine loop's worker thread between engine
steps, one at a time, so the session's GPU work never races the engine's graphs and the
Thinker's weights are shared with the turn-based engine (one copy). The speech side's
Talker and Token2Wav weights are loaded once, on the first session that speaks.

This is the exact per-session layer: a unit does not batch with other sessions' units.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

log = logging.getLogger(__name__)


class DuplexSessions:
    """The stage's sessions by id; every method runs on the engine loop's worker thread."""

    def __init__(self, source: Any, device: Any):
        self.source = source
        self.device = device
        self._sessions: dict[str, tuple[Any, Any]] = {}
        self._speech_models: Any = None
        self._special: set[str] | None = None
        self.units = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, engine: Any, sid: str, init: Any) -> None:
        from pipeline.duplex.config import DuplexConfig
        from pipeline.duplex.session import DuplexSession
        from pipeline.duplex.thinker import DuplexThinker, reference_special_tokens

        if sid in self._sessions:
            raise ValueError(f"duplex session {sid!r} is already open")
        opts = dict(init.options or {})
        seed = opts.pop("seed", None)
        cfg = DuplexConfig(**opts)  # ValueError for a bad option
        if self._special is None:
            self._special = reference_special_tokens(self.source.tokenizer_dir)
        thinker = DuplexThinker(engine.model, engine.tokenizer, cfg, seed=seed,
                                special_tokens=self._special)
        speech = self._speech(cfg, seed) if init.audio_out else None
        session = DuplexSession(thinker, speech)
        try:
            session.prepare(prefix=init.system_prompt, ref_audio=init.ref_audio,
                            prompt_wav=init.prompt_wav)
        except BaseException:
            session.close()
            raise
        self._sessions[sid] = (session, init.max_slice_nums)

    def _speech(self, cfg: Any, seed: int | None) -> Any:
        from pipeline.duplex.speech import DuplexSpeech, SpeechModels

        if self._speech_models is None:
            self._speech_models = SpeechModels.from_source(self.source, str(self.device))
            log.info("duplex speech models loaded on %s", self.device)
        return DuplexSpeech(self._speech_models, seed=0 if seed is None else int(seed),
                            temperature=cfg.tts_temperature,
                            repetition_penalty=cfg.tts_repetition_penalty)

    def unit(self, sid: str, audio: Any, frames: Any, force: str | None) -> dict[str, Any]:
        entry = self._sessions.get(sid)
        if entry is None:
            raise KeyError(f"no duplex session {sid!r}")
        session, slices = entry
        r = session.unit(audio, frames, force, slices)
        self.units += 1
        out = dataclasses.asdict(r)
        # the schema: a token id, or ("audio", n) / ("img", n) for n embedded rows
        out["prefill_tokens"] = sum(x[1] if isinstance(x, tuple) else 1
                                    for x in out.pop("prefill", None) or ())
        return out

    def close(self, sid: str) -> bool:
        entry = self._sessions.pop(sid, None)
        if entry is None:
            return False
        entry[0].close()
        return True

    def close_all(self) -> None:
        for sid in list(self._sessions):
            self.close(sid)

    def stats(self) -> dict[str, int]:
        return {"sessions": len(self._sessions), "units": self.units}
