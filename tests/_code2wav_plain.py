"""The plain Code2Wav path the shipped one is bounded against (tests only).

The engine runs every stream in a slot pool (pipeline/code2wav/slots.py), its vocoder's convs
as matmuls. Here is what that path replaces, as the reference modules compute it:
  * FlowCache's batch stacking, splitting and trimming, and its reference layout;
  * `stream_step`: one chunk of B streams of equal shapes through `Flow._chunk` (the DiT's
    `forward_chunk` over [new || cache], no padding) and the vocoder;
  * `PlainEngine`: the engine's protocol (open / feed / step / drain / abort) over
    `stream_step`, one stream at a time, with the engine's templates and noise generators;
  * `plain_convs`: the causal vocoder's convs as torch's conv over the padded input;
  * the offline decode of a whole utterance (`flow_inference`), the reference's
    `inference`: what a final chunk from an empty state equals.
"""

from __future__ import annotations

import contextlib
import zlib
from collections import Counter, OrderedDict
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.code2wav.causal_hift import _Conv, _padded
from pipeline.code2wav.flow import HISTORY_FRAMES, FlowCache
from pipeline.code2wav.stream import CodeCursor, Crossfade, initial_state, vocode
from pipeline.handoff import PcmChunk

# -- FlowCache ---------------------------------------------------------------------------


def cat(caches: list[FlowCache]) -> FlowCache:
    """Stack single streams into one batch (shapes must agree except the batch)."""

    def est(name):  # CFG rows: all conds first, then all unconds
        parts = [getattr(c, name) for c in caches]
        conds = [p[:, :, : p.shape[2] // 2] for p in parts]
        unconds = [p[:, :, p.shape[2] // 2 :] for p in parts]
        return torch.cat(conds + unconds, dim=2)

    return FlowCache(
        token_att=torch.cat([c.token_att for c in caches], dim=1),
        mel_att=torch.cat([c.mel_att for c in caches], dim=1),
        lookahead_cnn=torch.cat([c.lookahead_cnn for c in caches], dim=0),
        up_cnn=torch.cat([c.up_cnn for c in caches], dim=0),
        est_cnn=est("est_cnn"),
        est_att=est("est_att"),
    )


def split(c: FlowCache) -> list[FlowCache]:
    """Inverse of `cat`: one FlowCache per stream (views)."""
    b = c.batch
    return [
        FlowCache(
            token_att=c.token_att[:, i : i + 1],
            mel_att=c.mel_att[:, i : i + 1],
            lookahead_cnn=c.lookahead_cnn[i : i + 1],
            up_cnn=c.up_cnn[i : i + 1],
            est_cnn=c.est_cnn[:, :, [i, b + i]],
            est_att=c.est_att[:, :, [i, b + i]],
        )
        for i in range(b)
    ]


def trimmed(c: FlowCache, prompt_frames: int, history_frames: int = HISTORY_FRAMES) -> FlowCache:
    """Bound the caches after a chunk ([MU7] semantics): once a cache holds more than
    prompt + history mel frames keep the prompt part plus the `history_frames` most recent.
    The DiT cache is newest-first, so (like the reference) `[:P] ++ [-100:]` keeps the newest
    P frames plus the oldest 100; the conformer caches are oldest-first and keep prompt + the
    newest history, the token-rate layers at half rate."""
    out = c
    if c.est_len > prompt_frames + history_frames:
        a = c.est_att
        out = replace(out, est_att=torch.cat(
            [a[..., :prompt_frames, :], a[..., -history_frames:, :]], dim=4))
    if c.mel_len > prompt_frames + history_frames:
        t, m = c.token_att, c.mel_att
        ph, hh = prompt_frames // 2, history_frames // 2
        out = replace(
            out,
            token_att=torch.cat([t[:, :, :, :ph], t[:, :, :, t.shape[3] - hh :]], dim=3),
            mel_att=torch.cat(
                [m[:, :, :, :prompt_frames], m[:, :, :, m.shape[3] - history_frames :]], dim=3),
        )
    return out


def from_reference(d: dict[str, torch.Tensor], n_blocks: int, n_steps: int,
                   depth: int) -> FlowCache:
    """A FlowCache from the reference's dict (token_att packed duplicated beside mel_att)."""
    att, cnn = d["conformer_att_cache"], d["conformer_cnn_cache"]
    return FlowCache(
        token_att=att[:n_blocks, :, :, : att.shape[3] // 2],
        mel_att=att[n_blocks:],
        lookahead_cnn=cnn[:, :, :2],
        up_cnn=cnn[:, :, 2:],
        est_cnn=d["estimator_cnn_cache"][:n_steps, :depth],
        est_att=d["estimator_att_cache"][:n_steps, :depth],
    )


def slot_cache(pool, slot: int) -> FlowCache:
    """A slot pool's slot in FlowCache's layout (batch 1)."""
    p, st = pool.pool, pool.state[slot]
    pos = torch.tensor(st.est_pos, device=pool.device, dtype=torch.long)
    k = p.dit.k[:, :, :, slot].index_select(3, pos)
    v = p.dit.v[:, :, :, slot].index_select(3, pos)
    return FlowCache(
        token_att=p.token[:, slot : slot + 1, :, : st.token_len].clone(),
        mel_att=p.mel[:, slot : slot + 1, :, : st.mel_len].clone(),
        lookahead_cnn=p.lookahead[slot : slot + 1].clone(),
        up_cnn=p.up[slot : slot + 1].clone(),
        est_cnn=p.dit.cnn[:, :, :, slot].clone(),
        est_att=torch.cat([k, v], dim=-1).transpose(3, 4).contiguous(),
    )


# -- the plain step ------------------------------------------------------------------------


@torch.inference_mode()
def stream_step(flow, hift, cfg, states, tokens, last, crossfade):
    """Decode one chunk for B streams of equal cache shapes. tokens (B, T) -> speech (B, N)
    float32, and the new states (inputs not modified). T = 0 with `last`: vocoder flush."""
    b = len(states)
    if tokens.shape[1] == 0:  # final flush with nothing left to decode (flow not advanced)
        mel = torch.zeros(b, cfg.output_size, 0, device=states[0].spk.device)
        speech, out = vocode(hift, cfg, states, mel, True, crossfade)
        return speech, [replace(s, chunks=s.chunks + 1) for s in out]
    flow_cache = states[0].flow if b == 1 else cat([s.flow for s in states])
    spk = torch.cat([s.spk for s in states])
    mel, new_flow = flow._chunk(tokens, spk, flow_cache, last, None)
    speech, voiced = vocode(hift, cfg, states, mel, last, crossfade)
    flows = [new_flow] if b == 1 else split(new_flow)
    out = []
    for s, f in zip(voiced, flows):
        f = trimmed(f, s.prompt_frames, HISTORY_FRAMES)
        if b > 1:  # own the memory: a stream's state must not alias its batch-mates'
            f = f.clone()
        out.append(replace(s, flow=f, chunks=s.chunks + 1))
    return speech, out


class PlainEngine:
    """The engine's protocol over `stream_step`, one stream at a time: what the slot pool's
    padded steps are bounded against. Same templates (built by `initial_state`) and the same
    per-stream noise generators as Code2WavEngine with its default `hift_seed`."""

    def __init__(self, flow, hift, cfg, hift_seed: int | None = 0):
        self.flow, self.hift, self.cfg, self.hift_seed = flow, hift, cfg, hift_seed
        self.device = next(flow.parameters()).device
        self.crossfade = Crossfade(cfg.mel_overlap_frames * cfg.hift.hop_length, self.device)
        self.streams: OrderedDict = OrderedDict()
        self.counters: Counter = Counter()

    def open(self, rid, voice):
        v = voice.to(self.device)
        state = initial_state(self.flow, self.cfg, v.prompt_tokens, v.prompt_mel, v.spk_emb,
                              vocoder=self.hift)
        if self.hift_seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(self.hift_seed * 1_000_003 + zlib.crc32(rid.encode()))
            state.generator = gen
        self.streams[rid] = [state, CodeCursor.start(self.cfg)]

    def feed(self, rid, msg):
        self.streams[rid][1].push(list(msg.codes), msg.finished)

    def abort(self, rid):
        self.streams.pop(rid, None)

    def has_work(self):
        return any(c.next_chunk(self.cfg) is not None for _, c in self.streams.values())

    def step(self):
        out = []
        for sid, entry in self.streams.items():
            state, cursor = entry
            nxt = cursor.next_chunk(self.cfg)
            if nxt is None:
                continue
            codes, last = nxt
            tokens = torch.tensor([codes], dtype=torch.long, device=self.device)
            speech, (entry[0],) = stream_step(self.flow, self.hift, self.cfg, [state], tokens,
                                              last, self.crossfade)
            cursor.advance(self.cfg, last)
            out.append(PcmChunk(sid, speech.float().cpu().numpy()[0], last))
            self.counters["chunks"] += 1
        return out

    def drain(self, max_steps: int = 10_000):
        pieces: dict[str, list[np.ndarray]] = {}
        for _ in range(max_steps):
            if not self.has_work():
                break
            for chunk in self.step():
                pieces.setdefault(chunk.request_id, []).append(chunk.pcm)
        return pieces


# -- the vocoder's convs -----------------------------------------------------------------


def _plain_conv(self, x, left=0, right=0, up=1, bias=True):
    return self._conv_forward(_padded(x, left, right, up), self.weight,
                              self.bias if bias else None)


@contextlib.contextmanager
def plain_convs():
    """Every causal vocoder conv as torch's conv over its padded, upsampled input."""
    conv = _Conv.conv
    _Conv.conv = _plain_conv
    try:
        yield
    finally:
        _Conv.conv = conv


# -- offline (whole utterance) -------------------------------------------------------------


def encoder_offline(enc, xs: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """UpsampleConformerEncoder offline: xs (B,T,C) -> (B, stride*T, C); bidirectional within
    each valid length; zero right pad for the lookahead, zero left pad for its conv2."""
    t = xs.shape[1]
    mask = (torch.arange(t, device=xs.device)[None] < lens[:, None])[:, None]  # (B,1,T)
    xs, la = enc.embed(xs), enc.pre_lookahead_layer
    h = F.pad(F.leaky_relu(la.conv1(F.pad(xs.transpose(1, 2), (0, la.lookahead)))), (2, 0))
    xs = la.conv2(h).transpose(1, 2) + xs
    pos = enc._pos(t, xs)
    for layer in enc.encoders:
        xs, _ = layer(xs, pos, mask=mask)
    xs, _ = enc.up_layer(xs.transpose(1, 2))
    xs = xs.transpose(1, 2)
    t2 = xs.shape[1]
    mask = (torch.arange(t2, device=xs.device)[None] < (lens * enc.up_layer.stride)[:, None])
    xs = enc.up_embed(xs)
    pos = enc._pos(t2, xs)
    for layer in enc.up_encoders:
        xs, _ = layer(xs, pos, mask=mask[:, None])
    return enc.after_norm(xs)


def dit_offline(dit, x, mu, t_emb, spks, cond, mask=None) -> torch.Tensor:
    """The DiT offline: full bidirectional attention. mask: (B, 1, T) valid-frame mask or
    None. Returns v (B, 80, T)."""
    attn_mask = None if mask is None else mask.bool()[:, None]  # (B, 1, 1, T)
    c = t_emb[:, None]  # (B, 1, D)
    h = dit.in_proj(dit._inputs(x, mu, spks, cond))
    for block in dit.blocks:
        h, _, _ = block(h, c, mask=attn_mask)
    return dit.final_layer(h, c).transpose(1, 2).to(x.dtype)


@torch.inference_mode()
def flow_inference(flow, tokens, prompt_tokens, prompt_mel, spk) -> torch.Tensor:
    """Offline decode of one utterance. tokens (1,T), prompt_tokens (1,P), prompt_mel
    (1, 2P, 80), spk (1,192) -> mel (1, 80, 2T) (prompt frames sliced off)."""
    spk = flow.speaker(spk)
    all_tokens = torch.cat([prompt_tokens, tokens], dim=1)
    lens = torch.tensor([all_tokens.shape[1]], device=tokens.device)
    h = flow.encoder_proj(encoder_offline(
        flow.encoder, flow.input_embedding(torch.clamp(all_tokens, min=0)), lens))
    p = prompt_mel.shape[1]
    cond = torch.zeros_like(h)
    cond[:, :p] = prompt_mel
    mu, cond = h.transpose(1, 2).contiguous(), cond.transpose(1, 2).contiguous()
    mask = torch.ones(1, 1, h.shape[1], device=h.device, dtype=h.dtype)
    cfm, b, t = flow.decoder, 1, mu.shape[2]
    x = cfm.rand_noise[:, :, :t].to(mu.dtype).expand(b, -1, -1)
    t_emb, dt = cfm.time_table(mu.device, mu.dtype)
    mu_in, spk_in = torch.cat([mu, torch.zeros_like(mu)]), torch.cat([spk, torch.zeros_like(spk)])
    cond_in, mask_in = torch.cat([cond, torch.zeros_like(cond)]), torch.cat([mask, mask])
    for i in range(cfm.n_timesteps):
        v = dit_offline(cfm.estimator, torch.cat([x, x]), mu_in, t_emb[i].expand(2 * b, -1),
                        spk_in, cond_in, mask_in)
        x = x + dt[i] * cfm._guide(v, b)
    return x[:, :, p:]
