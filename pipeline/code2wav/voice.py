"""Voice prompts for Code2Wav: speech codes, speaker x-vector and mel of a reference recording.

A voice = (prompt_tokens (1,P) S3 codes at 25 Hz, spk_emb (1,192) CAMPPlus x-vector,
prompt_mel (1, 2P, 80) log-mel at 50 Hz). Sources:
  * the default voice: `assets/token2wav/default_voice.safetensors` when present (the tiny
    checkpoint writes it), else computed from `assets/HT_ref_audio.wav`;
  * a request's reference audio: computed by `PromptFrontend`, cached by content hash (LRU).

Front end (spec 3.3), for 16 kHz mono audio:
  1. S3 tokenizer v2 (`speech_tokenizer_v2_25hz.onnx`, onnxruntime) on a 128-bin Whisper log-mel
  2. CAMPPlus (`campplus.onnx`) on an 80-bin Kaldi fbank (dither 0, mean-normalized over time)
  3. 24 kHz resample -> Matcha mel (n_fft 1920, hop 480, fmax 8000, log clamp 1e-5)
     -> replicate-pad / truncate to 2 * len(tokens) frames.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

PROMPT_SR = 16000
MEL_SR = 24000


@dataclass(frozen=True)
class VoicePrompt:
    prompt_tokens: torch.Tensor  # (1, P) int64
    spk_emb: torch.Tensor  # (1, 192) float32
    prompt_mel: torch.Tensor  # (1, 2P, 80) float32

    def to(self, device) -> VoicePrompt:
        return VoicePrompt(
            self.prompt_tokens.to(device), self.spk_emb.to(device), self.prompt_mel.to(device)
        )

    @property
    def key(self) -> str:
        h = hashlib.sha256()
        for t in (self.prompt_tokens, self.spk_emb, self.prompt_mel):
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def save_voice(path: Path, voice: VoicePrompt) -> None:
    from safetensors.torch import save_file

    save_file(
        {
            "prompt_tokens": voice.prompt_tokens.to(torch.int64).contiguous(),
            "spk_emb": voice.spk_emb.float().contiguous(),
            "prompt_mel": voice.prompt_mel.float().contiguous(),
        },
        str(path),
    )


def load_voice(path: Path) -> VoicePrompt:
    from safetensors.torch import load_file

    d = load_file(str(path))
    missing = {"prompt_tokens", "spk_emb", "prompt_mel"} - set(d)
    if missing:
        raise ValueError(f"{path}: missing tensors {sorted(missing)}")
    v = VoicePrompt(d["prompt_tokens"].long(), d["spk_emb"].float(), d["prompt_mel"].float())
    if v.prompt_mel.shape[1] != 2 * v.prompt_tokens.shape[1]:
        raise ValueError(
            f"{path}: prompt_mel has {v.prompt_mel.shape[1]} frames, "
            f"expected 2 x {v.prompt_tokens.shape[1]}"
        )
    return v


# ---------------------------------------------------------------------------------------
# Signal processing (own implementations; no torchaudio / librosa)


def _hz_to_mel(f):
    """Slaney mel scale (librosa htk=False)."""
    f = np.asarray(f, dtype=np.float64)
    lin = f / (200.0 / 3)
    log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(f >= 1000.0, log, lin)


def _mel_to_hz(m):
    m = np.asarray(m, dtype=np.float64)
    lin = m * (200.0 / 3)
    log = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0))
    return np.where(m >= 15.0, log, lin)


def mel_filters(
    sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> np.ndarray:
    """Slaney-normalized triangular filters (n_mels, n_fft//2+1), librosa.filters.mel defaults."""
    fmax = sr / 2 if fmax is None else fmax
    fft_freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels]))[:, None]
    return weights.astype(np.float32)


def mel_spectrogram_24k(wav: torch.Tensor) -> torch.Tensor:
    """(1, N) 24 kHz -> (1, 80, frames) Matcha log-mel (spec 3.2)."""
    n_fft, hop = 1920, 480
    basis = torch.from_numpy(mel_filters(MEL_SR, n_fft, 80, 0, 8000)).to(wav.device)
    y = F.pad(wav[:, None], ((n_fft - hop) // 2, (n_fft - hop) // 2), mode="reflect")[:, 0]
    spec = torch.stft(
        y,
        n_fft,
        hop,
        n_fft,
        window=torch.hann_window(n_fft, device=wav.device),
        center=False,
        return_complex=True,
    )
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    return torch.log(torch.clamp(basis @ mag, min=1e-5))


def whisper_log_mel(wav: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """(N,) 16 kHz -> (n_mels, frames): Whisper log-mel (n_fft 400, hop 160), as s3tokenizer."""
    window = torch.hann_window(400)
    stft = torch.stft(wav, 400, 160, window=window, return_complex=True)
    mag = stft[..., :-1].abs() ** 2
    basis = torch.from_numpy(mel_filters(PROMPT_SR, 400, n_mels))
    log_spec = torch.clamp(basis @ mag, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def kaldi_fbank(wav: torch.Tensor, n_mels: int = 80, sr: int = PROMPT_SR) -> torch.Tensor:
    """(N,) float waveform -> (frames, n_mels): Kaldi fbank defaults (25 ms / 10 ms frames,
    snip edges, remove DC, pre-emphasis 0.97, povey window, 512-point power spectrum, HTK mel
    20 Hz..Nyquist, log with float eps floor), dither 0, as torchaudio.compliance.kaldi.fbank
    (checked against kaldi-native-fbank in the tests)."""
    wav = wav.double()  # the reference feeds [-1, 1] floats (no int16 scaling)
    flen, fshift, nfft = int(sr * 0.025), int(sr * 0.010), 512
    n = 1 + (wav.numel() - flen) // fshift
    frames = wav.as_strided((n, flen), (fshift, 1)).clone()
    frames = frames - frames.mean(dim=1, keepdim=True)
    frames = torch.cat(
        [frames[:, :1] - 0.97 * frames[:, :1], frames[:, 1:] - 0.97 * frames[:, :-1]], dim=1
    )
    window = torch.hann_window(flen, periodic=False, dtype=torch.float64).pow(0.85)
    power = torch.fft.rfft(F.pad(frames * window, (0, nfft - flen)), n=nfft).abs().pow(2)
    # HTK mel bins over 20 Hz .. sr/2, as Kaldi computes them.
    lo, hi = 1127.0 * math.log(1.0 + 20.0 / 700.0), 1127.0 * math.log(1.0 + (sr / 2) / 700.0)
    delta = (hi - lo) / (n_mels + 1)
    freqs = torch.arange(nfft // 2, dtype=torch.float64) * sr / nfft
    mf = 1127.0 * torch.log1p(freqs / 700.0)
    left = lo + torch.arange(n_mels, dtype=torch.float64)[:, None] * delta
    up = (mf[None] - left) / delta
    down = (left + 2 * delta - mf[None]) / delta
    banks = torch.clamp(torch.minimum(up, down), min=0.0)
    energies = power[:, : nfft // 2] @ banks.T
    eps = torch.finfo(torch.float32).eps
    return torch.log(torch.clamp(energies, min=eps)).float()


def resample(
    wav: torch.Tensor, orig: int, new: int, width: int = 6, rolloff: float = 0.99
) -> torch.Tensor:
    """Band-limited sinc resampling with a Hann-windowed kernel (torchaudio's default method)."""
    if orig == new:
        return wav
    g = math.gcd(orig, new)
    orig, new = orig // g, new // g
    base = min(orig, new) * rolloff
    w = math.ceil(width * orig / base)
    idx = torch.arange(-w, w + orig, dtype=torch.float64)[None, None] / orig
    t = (-torch.arange(new, dtype=torch.float64)[:, None, None] / new + idx) * base
    t = t.clamp(-width, width)
    window = torch.cos(t * math.pi / width / 2) ** 2
    t = t * math.pi
    kernel = (
        torch.where(t == 0, torch.tensor(1.0, dtype=torch.float64), torch.sin(t) / t)
        * window
        * base
        / orig
    )
    x = F.pad(wav.double().reshape(1, 1, -1), (w, w + orig))
    out = F.conv1d(x, kernel.to(x.dtype), stride=orig)  # (1, new, frames)
    n_out = math.ceil(new * wav.shape[-1] / orig)
    return out.transpose(1, 2).reshape(-1)[:n_out].to(wav.dtype)


def fit_prompt_mel(mel: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """(1, T, 80) -> (1, 2*n_tokens, 80): replicate-pad or truncate (the reference's rule)."""
    target = 2 * n_tokens
    if mel.shape[1] >= target:
        return mel[:, :target]
    return F.pad(mel.transpose(1, 2), (0, target - mel.shape[1]), mode="replicate").transpose(1, 2)


# ---------------------------------------------------------------------------------------
# ONNX front ends


class PromptFrontend:
    """S3 tokenizer v2 + CAMPPlus through onnxruntime (CPU), mel in torch."""

    def __init__(self, token2wav_dir: Path):
        try:
            import onnxruntime
        except ImportError as e:
            raise RuntimeError(
                "reference-audio voices need onnxruntime (pip install onnxruntime) to run "
                "speech_tokenizer_v2_25hz.onnx and campplus.onnx"
            ) from e
        token2wav_dir = Path(token2wav_dir)
        paths = [token2wav_dir / "speech_tokenizer_v2_25hz.onnx", token2wav_dir / "campplus.onnx"]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{token2wav_dir}: missing voice front-end models {missing}")
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = 1
        self.tokenizer = onnxruntime.InferenceSession(
            str(paths[0]), sess_options=opts, providers=["CPUExecutionProvider"]
        )
        self.campplus = onnxruntime.InferenceSession(
            str(paths[1]), sess_options=opts, providers=["CPUExecutionProvider"]
        )

    def __call__(self, wav: np.ndarray, sample_rate: int) -> VoicePrompt:
        """wav: (N,) or (N, channels) float in [-1, 1] (soundfile layout)."""
        audio = torch.as_tensor(np.asarray(wav, dtype=np.float32))
        if audio.ndim == 1:
            audio = audio[:, None]
        # Like the reference: codes and x-vector from the first channel, mel from the mean.
        audio16 = resample(audio[:, 0], sample_rate, PROMPT_SR)
        feats = whisper_log_mel(audio16)[None].numpy()  # (1, 128, T)
        ins = self.tokenizer.get_inputs()
        tokens = self.tokenizer.run(
            None, {ins[0].name: feats, ins[1].name: np.array([feats.shape[2]], dtype=np.int32)}
        )[0]
        tokens = torch.as_tensor(tokens).reshape(1, -1).long()
        fb = kaldi_fbank(audio16)
        fb = fb - fb.mean(dim=0, keepdim=True)
        spk = self.campplus.run(None, {self.campplus.get_inputs()[0].name: fb[None].numpy()})[0]
        mel24 = resample(audio.mean(dim=1), sample_rate, MEL_SR)
        mel = mel_spectrogram_24k(mel24[None]).transpose(1, 2)  # (1, T, 80)
        return VoicePrompt(
            tokens,
            torch.as_tensor(spk).reshape(1, -1).float(),
            fit_prompt_mel(mel, tokens.shape[1]),
        )


class VoiceCache:
    """Default voice + an LRU of reference-audio voices keyed by sha256 of the samples."""

    def __init__(self, token2wav_dir: Path, capacity: int = 8):
        self.dir = Path(token2wav_dir)
        self.capacity = capacity
        self._lru: OrderedDict[str, VoicePrompt] = OrderedDict()
        self._frontend: PromptFrontend | None = None
        self._default: VoicePrompt | None = None

    def frontend(self) -> PromptFrontend:
        if self._frontend is None:
            self._frontend = PromptFrontend(self.dir)
        return self._frontend

    def default(self) -> VoicePrompt:
        if self._default is None:
            path = self.dir / "default_voice.safetensors"
            if path.is_file():
                self._default = load_voice(path)
            else:
                import soundfile

                wav, sr = soundfile.read(str(self.dir.parent / "HT_ref_audio.wav"), dtype="float32")
                self._default = self.frontend()(wav, sr)
        return self._default

    def from_audio(self, wav: np.ndarray, sample_rate: int) -> VoicePrompt:
        arr = np.ascontiguousarray(np.asarray(wav, dtype=np.float32))
        key = hashlib.sha256(arr.tobytes() + str(sample_rate).encode()).hexdigest()
        if key in self._lru:
            self._lru.move_to_end(key)
            return self._lru[key]
        voice = self.frontend()(arr, sample_rate)
        self._lru[key] = voice
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)
        return voice
