"""The flow's streaming caches for many streams at once: a slot pool of fixed-capacity buffers,
and batches of padded rows that any mix of streams can share.

Why: the per-stream caches (flow.FlowCache) change length over a turn's first chunks, differ by
voice and are concatenated and trimmed with `cat` after every chunk, so only streams in the same
phase could batch, and every batch shape needed its own graph. Here each stream owns one slot of
preallocated buffers and the host keeps the lengths; a chunk of any phase, voice or final length
is a row padded to one shape, so every ready stream runs in one step and a step's shape depends
only on the batch size (and the DiT window, see below).

What each cache becomes (flow.FlowPool):
  * conformer K/V, per rate: left-aligned, oldest first, as in the reference. A row attends
    [capacity || chunk] with a mask; its relative positions are gathered from the window of
    `_pos(capacity + chunk)`; the new (trimmed) cache is a gather from [cache || chunk].
  * DiT K/V, per Euler step and block: attention has no positions, so frames live anywhere in
    the slot. A chunk's frames that the trim keeps go to free positions, the others to a
    scratch range after the window; only the new frames are written (attention still reads
    the batch's rows through one gather per block: an in-place kernel would remove it).
  * conv tails (lookahead, upsample, DiT convs): gathered at each row's last valid frames.

`FlowSlotPool.plan(rows)` computes every index on the host (no syncs on the device), the
model's `forward_slots` runs the chunk, `commit` advances the host bookkeeping. Batched rows
compute what one stream at a time computes, up to the order of float sums in masked softmax
and matmuls over padded keys (tests/test_code2wav_slots.py bounds it over long streams).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, is_dataclass, replace

import torch

from pipeline.code2wav.dit import DiTPool, DiTSlots
from pipeline.code2wav.flow import (
    HISTORY_FRAMES,
    NOISE_FRAMES,
    ConformerSlots,
    Flow,
    FlowCache,
    FlowPool,
    FlowSlots,
)

WINDOW_ALIGN = 64  # DiT windows are rounded up to this many frames (fewer graph shapes)


class NoFreeSlot(RuntimeError):
    """Every slot holds a stream: the app's capacity keeps turns below this."""

@dataclass
class SlotState:
    """Host bookkeeping of one resident stream."""

    prompt_frames: int  # P, mel frames of the voice prompt (trimming keeps them)
    token_len: int  # valid frames of the token-rate conformer caches
    mel_len: int  # valid frames of the mel-rate conformer caches
    est_pos: list[int] = field(default_factory=list)  # DiT positions, newest first (logical)


@dataclass
class Row:
    """One stream's next chunk: codes incl. the lookahead unless `last`."""

    slot: int
    codes: list[int]
    last: bool


@dataclass
class Plan:
    """A planned batch: the model inputs and what `commit` applies afterwards."""

    tokens: torch.Tensor  # (B, T + 2 lookahead) long, CPU
    index: FlowSlots  # CPU tensors; index.dit.window is part of the graph key
    mel_frames: list[int]  # valid mel frames of each real row
    updates: list[tuple[int, SlotState]]  # (slot, its state after the chunk), non-final rows


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _trim(seq: list, first: int, last: int) -> list:
    """The reference's cache trimming on a list of frames: the first `first`, the last `last`."""
    return seq[:first] + seq[len(seq) - last :]


class FlowSlotPool:
    def __init__(self, flow: Flow, slots: int, max_prompt_frames: int, device, dtype):
        cfg = flow.cfg
        e = cfg.encoder
        self.flow, self.slots, self.device = flow, slots, torch.device(device)
        self.lookahead, self.up = cfg.pre_lookahead, e.up_stride
        self.chunk = cfg.chunk_size
        self.t_tok = cfg.chunk_size + cfg.pre_lookahead  # encoder rows after the lookahead conv
        self.t_mel = self.t_tok * self.up
        self.max_prompt_frames, self.dtype = max_prompt_frames, dtype
        hist_tok = HISTORY_FRAMES // self.up
        self.token_cap = max_prompt_frames // self.up + hist_tok
        self.mel_cap = max_prompt_frames + HISTORY_FRAMES
        # Old frames stay attended during the chunk that trims them, so the new ones need room
        # beside them: prompt + history + one chunk; then the scratch range of one chunk.
        self.est_main = _round_up(max_prompt_frames + HISTORY_FRAMES + cfg.chunk_size * self.up,
                                  WINDOW_ALIGN)
        self.pool = self._allocate(slots + 1)  # the last row is a spare for padding rows
        self.spare = slots
        self.free = list(range(slots))
        self.state: dict[int, SlotState] = {}

    def _allocate(self, rows: int) -> FlowPool:
        """Zeroed caches of `rows` slot rows."""
        cfg = self.flow.cfg
        e, d = cfg.encoder, cfg.dit
        h, dk = e.attention_heads, e.output_size // e.attention_heads
        s, depth = self.flow.decoder.n_timesteps, d.depth
        est_cap = self.est_main + self.t_mel
        z = {"device": self.device, "dtype": self.dtype}
        # the DiT's caches in its own dtype (bf16 under token2wav_precision bf16)
        zd = {"device": self.device, "dtype": self.flow.decoder.estimator.in_proj.weight.dtype}
        return FlowPool(
            token=torch.zeros(e.num_blocks, rows, h, self.token_cap, 2 * dk, **z),
            mel=torch.zeros(e.num_up_blocks, rows, h, self.mel_cap, 2 * dk, **z),
            lookahead=torch.zeros(rows, e.output_size, 2, **z),
            up=torch.zeros(rows, e.output_size, 2 * self.up, **z),
            dit=DiTPool(
                k=torch.zeros(s, depth, 2, rows, est_cap, d.num_heads, d.head_dim, **zd),
                v=torch.zeros(s, depth, 2, rows, est_cap, d.num_heads, d.head_dim, **zd),
                cnn=torch.zeros(s, depth, 2, rows, 2 * d.hidden_size, 2, **zd),
            ),
        )

    def grow(self, slots: int) -> None:
        """`slots` slots (more than now): the resident streams' caches copied into new
        buffers, the spare row moved to the end. Anything captured over the old buffers (the
        engine's flow graphs) must be dropped."""
        if slots <= self.slots:
            raise ValueError(f"grow to {slots} slots: the pool has {self.slots}")
        old, new, n = self.pool, self._allocate(slots + 1), self.slots
        new.token[:, :n] = old.token[:, :n]
        new.mel[:, :n] = old.mel[:, :n]
        new.lookahead[:n] = old.lookahead[:n]
        new.up[:n] = old.up[:n]
        for name in ("k", "v", "cnn"):
            getattr(new.dit, name)[:, :, :, :n] = getattr(old.dit, name)[:, :, :, :n]
        self.pool, self.slots, self.spare = new, slots, slots
        self.free = sorted(self.free + list(range(n, slots)))

    def nbytes(self) -> int:
        p = self.pool
        return sum(t.numel() * t.element_size()
                   for t in (p.token, p.mel, p.lookahead, p.up, p.dit.k, p.dit.v, p.dit.cnn))

    # -- residency -----------------------------------------------------------------------

    def admit(self, cache: FlowCache, prompt_frames: int) -> int:
        """Copy a stream's initial cache (a voice template, batch 1) into a free slot."""
        if not self.free:
            raise NoFreeSlot(f"all {self.slots} Code2Wav slots are in use")
        self.check_prompt(prompt_frames)
        slot = self.free.pop(0)
        p, lt, lm, le = self.pool, cache.token_att.shape[3], cache.mel_len, cache.est_len
        p.token[:, slot, :, :lt] = cache.token_att[:, 0]
        p.mel[:, slot, :, :lm] = cache.mel_att[:, 0]
        p.lookahead[slot] = cache.lookahead_cnn[0]
        p.up[slot] = cache.up_cnn[0]
        dh = p.dit.k.shape[-1]
        att = cache.est_att.transpose(3, 4)  # (S, depth, 2, L, H, 2dh)
        p.dit.k[:, :, :, slot, :le] = att[..., :dh]
        p.dit.v[:, :, :, slot, :le] = att[..., dh:]
        p.dit.cnn[:, :, :, slot] = cache.est_cnn
        self.state[slot] = SlotState(prompt_frames, lt, lm, list(range(le)))
        return slot

    def check_prompt(self, prompt_frames: int) -> None:
        """ValueError when a voice prompt of `prompt_frames` is longer than a slot holds."""
        if prompt_frames > self.max_prompt_frames:
            raise ValueError(
                f"voice prompt of {prompt_frames} mel frames is longer than the "
                f"{self.max_prompt_frames} a Code2Wav slot holds (slot_prompt_frames)"
            )

    def release(self, slot: int) -> None:
        if self.state.pop(slot, None) is not None:
            self.free.append(slot)
            self.free.sort()

    # -- planning ------------------------------------------------------------------------

    def _conformer(self, length: int, cap: int, t: int, valid: int, keep: list[int]):
        """mask, rel, keep of one row at one rate (see flow.ConformerSlots)."""
        mask, rel = _conformer_mask_rel(length, cap, t, valid)
        keep_ix = torch.zeros(cap, dtype=torch.long)
        keep_ix[: len(keep)] = torch.tensor(keep, dtype=torch.long)
        return mask, rel, keep_ix

    def plan(self, rows: list[Row], batch: int | None = None) -> Plan:
        """Index tensors of one batched chunk for `rows` (distinct slots), padded with spare
        rows up to `batch` rows."""
        b = batch or len(rows)
        if len(rows) > b or len({r.slot for r in rows}) != len(rows):
            raise ValueError("rows must be distinct slots, at most the batch size")
        t_in, t_tok, t_mel, up = self.t_tok + self.lookahead, self.t_tok, self.t_mel, self.up
        tokens = torch.zeros(b, t_in, dtype=torch.long)
        emb_keep = torch.zeros(b, t_in, 1)
        la_tail = torch.zeros(b, 1, 2, dtype=torch.long)
        up_tail = torch.zeros(b, 1, 2 * up, dtype=torch.long)
        conv_tail = torch.zeros(b, 1, 2, dtype=torch.long)
        noise = torch.zeros(b, t_mel, dtype=torch.long)
        tok = [self._conformer(0, self.token_cap, t_tok, 1, [])] * b
        mel = [self._conformer(0, self.mel_cap, t_mel, 1, [])] * b
        targets: list[list[int | None]] = [[None] * t_mel for _ in range(b)]
        old_pos: list[list[int]] = [[] for _ in range(b)]
        slots = torch.full((b,), self.spare, dtype=torch.long)
        mel_frames, updates = [], []
        for i, r in enumerate(rows):
            st = self.state[r.slot]
            n = len(r.codes)
            if not 0 < n <= t_tok or (not r.last and n <= self.lookahead):
                raise ValueError(f"chunk of {n} codes (last={r.last})")
            v = n if r.last else n - self.lookahead  # codes decoded
            p = st.prompt_frames
            slots[i] = r.slot
            tokens[i, :n] = torch.tensor(r.codes, dtype=torch.long)
            emb_keep[i, :n] = 1.0
            la_tail[i, 0] = torch.tensor([max(v - 2, 0), max(v - 1, 0)])
            up_tail[i, 0] = torch.arange(2 * v, 2 * v + 2 * up)
            conv_tail[i, 0] = torch.tensor([2 * v, 2 * v + 1])
            le = len(st.est_pos)
            noise[i] = (le + torch.arange(t_mel)).clamp(max=NOISE_FRAMES - 1)
            # conformer: new = [cache || chunk], trimmed when the mel-rate length passes P + 100
            tok_new = list(range(st.token_len)) + [self.token_cap + j for j in range(v)]
            mel_new = list(range(st.mel_len)) + [self.mel_cap + j for j in range(2 * v)]
            if len(mel_new) > p + HISTORY_FRAMES:
                tok_new = _trim(tok_new, p // up, HISTORY_FRAMES // up)
                mel_new = _trim(mel_new, p, HISTORY_FRAMES)
            tok[i] = self._conformer(st.token_len, self.token_cap, t_tok, v,
                                     [] if r.last else tok_new)
            mel[i] = self._conformer(st.mel_len, self.mel_cap, t_mel, 2 * v,
                                     [] if r.last else mel_new)
            # DiT: logical list = [new frames || old], trimmed to [:P] ++ [-100:]
            logical: list[tuple[str, int]] = [("new", j) for j in range(2 * v)]
            logical += [("old", q) for q in st.est_pos]
            if len(logical) > p + HISTORY_FRAMES:
                logical = _trim(logical, p, HISTORY_FRAMES)
            old_pos[i] = st.est_pos
            if not r.last:
                used = set(st.est_pos)
                free = iter(q for q in range(self.est_main) if q not in used)
                kept_pos = []
                for kind, j in logical:
                    if kind == "new":
                        targets[i][j] = next(free)
                        kept_pos.append(targets[i][j])
                    else:
                        kept_pos.append(j)
                tl, ml = len(tok_new), len(mel_new)
                updates.append((r.slot, SlotState(p, tl, ml, kept_pos)))
            mel_frames.append(2 * v)
        used_max = max([q for row in old_pos for q in row]
                       + [q for row in targets for q in row if q is not None] + [0])
        base = min(_round_up(used_max + 1, WINDOW_ALIGN), self.est_main)
        window = base + t_mel
        write = torch.tensor(
            [[base + j if q is None else q for j, q in enumerate(row)] for row in targets]
        )
        att_mask = torch.zeros(b, window, dtype=torch.bool)
        for i in range(b):
            valid = mel_frames[i] if i < len(rows) else 1
            att_mask[i, old_pos[i]] = True
            att_mask[i, write[i, :valid]] = True

        def stack(parts, j):
            return torch.stack([x[j] for x in parts])

        def two(x):  # CFG rows: conds then unconds
            return torch.cat([x, x])

        index = FlowSlots(
            slots=slots,
            emb_keep=emb_keep,
            la_tail=la_tail,
            up_tail=up_tail,
            token=ConformerSlots(stack(tok, 0)[:, None, None], stack(tok, 1)[:, None],
                                 stack(tok, 2)[:, None, :, None]),
            mel=ConformerSlots(stack(mel, 0)[:, None, None], stack(mel, 1)[:, None],
                               stack(mel, 2)[:, None, :, None]),
            noise=noise,
            dit=DiTSlots(
                cfg=torch.cat([torch.zeros(b, 1), torch.ones(b, 1)]).long(),
                rows=two(slots)[:, None],
                write=two(write),
                mask=two(att_mask)[:, None, None],
                window=window,
                conv_tail=two(conv_tail),
            ),
        )
        return Plan(tokens, index, mel_frames, updates)

    def blank_plan(self, batch: int, window: int) -> Plan:
        """A plan of `batch` padding rows with DiT window `window`: every write goes to the
        spare slot, so running it changes no stream (graph capture runs the step on it)."""
        plan = self.plan([], batch)
        base = window - self.t_mel
        write = (base + torch.arange(self.t_mel)).expand(2 * batch, -1).clone()
        mask = torch.zeros(2 * batch, 1, 1, window, dtype=torch.bool)
        mask[..., base] = True
        dit = replace(plan.index.dit, write=write, mask=mask, window=window)
        return replace(plan, index=replace(plan.index, dit=dit))

    def commit(self, plan: Plan) -> None:
        """The host side of a chunk that has been enqueued: new lengths and positions."""
        for slot, st in plan.updates:
            self.state[slot] = st


@functools.lru_cache(maxsize=256)
def _conformer_mask_rel(length: int, cap: int, t: int, valid: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's key mask and relative positions at one rate: a function of its lengths alone,
    which stop changing once a stream's caches are trimmed, so later steps reuse them (plan
    only reads them; torch.stack copies). Built every step, their small CPU tensor ops were
    most of the plan's host time, which the step's wall holds before its first launch. A
    stream passes through a few lengths per rate; 256 entries of at most ~0.3 MB (the
    full-size mel rate's (56, 656) positions) bound the host memory to ~75 MB."""
    k = cap + t
    pos_k = torch.cat([torch.arange(cap), length + torch.arange(t)])
    pos_q = length + torch.arange(t)
    rel = ((k - 1) - (pos_q[:, None] - pos_k[None])).clamp(0, 2 * k - 2)
    mask = torch.zeros(k, dtype=torch.bool)
    mask[:length] = True
    mask[cap : cap + valid] = True
    return mask, rel


def flatten(ix) -> list[torch.Tensor]:
    """The tensors of an index bundle (FlowSlots) in field order: a graph's static inputs."""
    out = []
    for f in fields(ix):
        v = getattr(ix, f.name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif is_dataclass(v):
            out.extend(flatten(v))
    return out


def unflatten(like, tensors) -> FlowSlots:
    """Inverse of `flatten`: `like`'s structure (and Python values) with `tensors` in it."""
    it = iter(tensors)

    def build(obj):
        kw = {}
        for f in fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, torch.Tensor):
                kw[f.name] = next(it)
            elif is_dataclass(v):
                kw[f.name] = build(v)
        return replace(obj, **kw)

    return build(like)


def index_to(ix: FlowSlots, device, non_blocking: bool = False) -> FlowSlots:
    """The plan's tensors on `device` (the window stays a Python int)."""
    return unflatten(ix, [t.to(device, non_blocking=non_blocking) for t in flatten(ix)])
