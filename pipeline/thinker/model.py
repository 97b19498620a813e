"""The Thinker: SigLIP + resampler (images), Whisper + projection (audio), Qwen3 (text).

    image slices --vpm--> (S, L, 1152) --resampler--> (S, 64, H)   one row per <unk> slot
    audio mel    --apm--> (T', 1024) --projection--> (T', H) --avgpool 5--> (n, H)
    prompt ids   --embed--> (P, H), <unk> rows replaced by the media rows above
                 --Qwen3 (paged KV, continuous batching: pipeline/thinker/llm_engine)--> next token

`ThinkerModel` only holds the modules and encodes media; the engine
(`pipeline/thinker/engine.py`) splices, schedules and samples.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.checkpoint import (
    ModelSource,
    audio_projection_schema,
    audio_schema,
    llm_schema,
    load_into,
    load_part,
    optional_patterns,
    resampler_schema,
    vision_schema,
)
from pipeline.config import ThinkerConfig
from pipeline.graphs import GraphRunner
from pipeline.handoff import AudioInput, ImageInput
from pipeline.processing.image import normalize_pixels
from pipeline.thinker.audio import AudioEncoder, pooled_tokens
from pipeline.thinker.llm import Qwen3LM
from pipeline.thinker.resampler import Resampler
from pipeline.thinker.vision import VisionEncoder, compile_vision_layers, pack_strips
from pipeline.utils import default_dtype


class ThinkerModel(nn.Module):
    def __init__(self, cfg: ThinkerConfig):
        super().__init__()
        self.cfg = cfg
        self.vpm = VisionEncoder(cfg.vision)
        self.resampler = Resampler.from_config(cfg)
        self.audio = AudioEncoder.from_config(cfg)  # children: apm, audio_projection_layer
        self.llm = Qwen3LM(cfg.llm)

    @classmethod
    def load(cls, source: ModelSource, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32,
             compile_mm_encoder: bool = False) -> ThinkerModel:
        """Build on the target device, then load every part strictly (`compile_mm_encoder`:
        the vision layers compiled, CUDA)."""
        cfg = source.config.thinker
        with torch.device(device), default_dtype(dtype):
            model = cls(cfg)
        t, opt = source.tensors, optional_patterns(cfg)

        def part(prefix: str, schema: dict) -> dict[str, torch.Tensor]:
            return load_part(t, prefix, schema, device, dtype, opt)

        audio_state = {"apm." + k: v for k, v in part("apm.", audio_schema(cfg)).items()}
        audio_state.update({"audio_projection_layer." + k: v for k, v in
                            part("audio_projection_layer.", audio_projection_schema(cfg)).items()})
        for name, module, state in (
            ("vpm", model.vpm, part("vpm.", vision_schema(cfg))),
            ("resampler", model.resampler, part("resampler.", resampler_schema(cfg))),
            ("apm", model.audio, audio_state),
            ("llm", model.llm, part("llm.", llm_schema(cfg))),
        ):
            load_into(module, state, name)
            del state
        model.eval()
        if compile_mm_encoder:
            compile_vision_layers(model.vpm)
        return model

    # -- media --------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up_vision(self, batch_size: int = 16) -> list[tuple[int, bool]]:
        """One vision pass per kind of batch a compiled encoder traces a graph for: a lone
        slice, several slices of one size (no padding), and slices of mixed sizes (the
        padding mask), so the first request does not pay the compile. The symbolic B and L
        cover every other size (compile_vision_layers). Returns (strips, padded) per pass."""
        s = self.cfg.slicing
        side = s.scale_resolution // s.patch_size  # a 448x448 slice: 32 x 32 patches
        full, half = (side, side), (side, max(1, side // 2))
        passes = [[full], [full, full], [full, half]][: 1 + min(2, batch_size - 1)]
        for sizes in passes:
            self.encode_images([self.blank_image(sizes)], batch_size)
        return [(len(sizes), len(set(sizes)) > 1) for sizes in passes]

    def blank_image(self, sizes: list[tuple[int, int]] | None = None,
                    content_hash: str = "") -> ImageInput:
        """An all-black image of slices of `sizes` (h, w) patches; one 448x448 slice by
        default. For warm-ups: it has the shapes of a real one."""
        s = self.cfg.slicing
        sizes = sizes or [(s.scale_resolution // s.patch_size,) * 2]
        strips = [torch.zeros(3, s.patch_size, s.patch_size * h * w, dtype=torch.uint8)
                  for h, w in sizes]
        return ImageInput(strips, torch.tensor(sizes, dtype=torch.int32), content_hash)

    @torch.inference_mode()
    def encode_images(self, images: list[ImageInput], batch_size: int = 16) -> list[torch.Tensor]:
        """Every slice of every image, batched `batch_size` slices per vision forward.
        Returns per image (num_slices * query_num, H)."""
        strips = [s for im in images for s in im.pixel_values]
        sizes = torch.cat([im.tgt_sizes.reshape(-1, 2) for im in images]) if images else None
        if not strips:
            return []
        device, dtype = self.llm.lm_head.weight.device, self.llm.lm_head.weight.dtype
        # Sort by length so each batch pads little; restore order afterwards.
        lens = (sizes[:, 0] * sizes[:, 1]).tolist()
        order = sorted(range(len(strips)), key=lambda i: lens[i])
        batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
        rows: list[torch.Tensor | None] = [None] * len(strips)
        for idx in batches:
            pix, tgt, mask = pack_strips([strips[i] for i in idx], sizes[idx])
            out = self._encode_batch(pix.to(device, non_blocking=True), tgt, mask, dtype)
            for j, i in enumerate(idx):
                rows[i] = out[j]
        result, k = [], 0
        for im in images:
            result.append(torch.cat(rows[k : k + im.num_slices], dim=0))
            k += im.num_slices
        return result

    def _encode_batch(self, pix: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
        """One packed batch of slices on the device -> (b, Q, H)."""
        if pix.dtype == torch.uint8:  # normalize on the device, then zero the padding
            keep = mask.to(pix.device).repeat_interleave(pix.shape[2], dim=-1)[:, :, None]
            pix = torch.where(keep, normalize_pixels(pix), 0.0)
        feats = self.vpm(pix.to(dtype), tgt, mask)
        return self.resampler(feats, tgt)  # (b, Q, H)

    @torch.inference_mode()
    def encode_audios(
        self, audios: list[AudioInput], graphs: AudioGraphs | None = None
    ) -> list[torch.Tensor]:
        """All clips in one batched encoder call -> per clip (num_tokens, H). With `graphs`,
        a lone clip of at most one window replays its bucket's graph instead."""
        if not audios:
            return []
        if graphs is not None:
            if len(audios) == 1 and graphs.bucket(audios[0].num_frames) is not None:
                return [graphs.encode(audios[0].features)]
            graphs.runner.fallback()
        device, dtype = self.llm.lm_head.weight.device, self.llm.lm_head.weight.dtype
        lengths = [a.num_frames for a in audios]
        mel = self.cfg.audio.num_mel_bins
        batch = torch.zeros(len(audios), mel, max(lengths), dtype=dtype)
        for i, a in enumerate(audios):
            batch[i, :, : a.num_frames] = a.features
        return self.audio(batch.to(device, non_blocking=True), lengths)


# Mel-frame buckets of the audio graphs (the window, 3000, is always one): a realtime turn's
# utterance is 1-10 s (100-1000 frames), a clip's audio track its 30 s window.
AUDIO_GRAPH_FRAMES = (256, 512, 1024, 2048)


class AudioGraphs:
    """The audio encoder, projection and pooling of one clip of at most one window (30 s)
    as a CUDA graph per bucket of mel frames. Why: an eager pass is host-bound at any clip
    length, and it sits on the first-text path of a spoken turn (a realtime utterance, a
    voice message). The clip is padded with zero frames to its bucket and masked as a
    shorter clip batched beside a longer one is (`WhisperEncoder.masks`): its tokens are
    those it gets alone, up to the order in which kernels over more rows sum. The masks are
    inputs, so one graph serves every length of its bucket. Outputs are copied out of the
    graph's static buffer."""

    def __init__(self, audio: AudioEncoder, dtype: torch.dtype,
                 buckets: tuple[int, ...] = AUDIO_GRAPH_FRAMES):
        self.audio, self.dtype = audio, dtype
        window = audio.apm.max_mel_frames
        self.buckets = (*sorted(b for b in buckets if b < window), window)
        self.runner = GraphRunner(max_graphs=len(self.buckets))

    @classmethod
    def of(cls, model: ThinkerModel) -> AudioGraphs:
        return cls(model.audio, model.llm.lm_head.weight.dtype)

    def bucket(self, frames: int) -> int | None:
        return next((b for b in self.buckets if b >= frames), None)

    @torch.inference_mode()
    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """features (n_mels, n) of one clip, n <= the window -> (num_tokens(n), H)."""
        n = features.shape[1]
        t = self.bucket(n)
        assert t is not None, f"a clip of {n} mel frames is over the audio window"
        device = self.audio.apm.conv1.weight.device
        padded = torch.zeros(1, features.shape[0], t, dtype=self.dtype)
        padded[0, :, :n] = features
        mel_valid, mask = self.audio.apm.masks([n], t, device)
        out = self.runner.run(t, [padded.to(device, non_blocking=True), mel_valid, mask],
                              self._forward)
        return out[0, : pooled_tokens(n, self.audio.pool_step)].clone()

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket now (a silent clip of each length), so no request captures one."""
        mels = self.audio.apm.cfg.num_mel_bins
        for t in self.buckets:
            self.encode(torch.zeros(mels, t))

    def _forward(self, features: torch.Tensor, mel_valid: torch.Tensor, mask: torch.Tensor):
        return self.audio.tokens(self.audio.apm.run(features, mel_valid, mask))
