"""LLMEngine: a single-threaded continuous-batching engine over one model.

    engine = LLMEngine(model, EngineConfig(...), device, dtype)
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step(): ...

Construction, in order: KV cache (sized from a byte budget or a block count) ->
block manager + scheduler -> attention backend (FlashInfer on CUDA, torch elsewhere) ->
runner (+ CUDA graphs on CUDA with FlashInfer, unless `cuda_graphs=False`).
The caller (a deployment) drives `step()` in a loop; nothing here spawns threads, and a step
waits only for the device (for the step before it when launching ahead, below).

Prefix caching (`enable_prefix_caching`, on by default): a request whose prompt starts
with the tokens (and, at multimodal positions, the media content keys of `mm_spans`) of
full blocks another request already computed reuses their K/V and computes only the rest.
Cached and uncached prefill differ by float summation order only (the same as chunked
prefill: tests/test_prefix_cache.py bounds it). A caller may leave out the embedding rows
of spans it expects inside a cached prefix (`cached_prefix_len` says how far that is);
should the prefix be evicted before the request runs, or the request be preempted, the
engine asks `media_loader` for those rows before a step computes them.

Every step computes every running decode plus prompt tokens (chunks) up to
`max_num_batched_tokens`. A caller whose media are still being encoded adds the request with
`num_ready` (positions whose rows exist) and hands the later rows over with `supply_media` as
they come; steps compute up to `num_ready` only, so prefill chunks start before the last
media row exists.

Launching ahead (on CUDA; a CPU step is done when launched: nothing to overlap): `step()`
plans and launches the next step before it waits for the one in flight, and returns that
one's outputs, so the host's work overlaps the GPU's instead of stalling it between steps.
The step launched ahead feeds each pending id from the device (runner.py); a sequence the
in-flight step stops computes one row more, which is dropped (scheduler.py). Outputs come one
`step()` later; `has_unfinished()` holds until the last launched step is returned. The tokens
are those of synchronous steps, up to the float summation order of a batch that holds a
stopped row for one step more.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.thinker.llm_engine.attention import FlashInferAttention, make_backend
from pipeline.thinker.llm_engine.graphs import LLMGraphRunner
from pipeline.thinker.llm_engine.kv_cache import BlockManager, KVCache, num_blocks_for_budget
from pipeline.thinker.llm_engine.runner import GuestRows, LaunchedStep, ModelRunner
from pipeline.thinker.llm_engine.sampling import make_generator
from pipeline.thinker.llm_engine.scheduler import (
    MediaSpan,
    ScheduledSeq,
    Scheduler,
    Sequence,
    StepPlan,
    extend_hashes,
    is_decoding,
)
from pipeline.handoff import SamplingParams

# (request id, spans without rows) -> one (end - start, H) tensor per span, in order
MediaLoader = Callable[[str, list[MediaSpan]], list[torch.Tensor]]


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8  # running sequences per step
    max_num_batched_tokens: int = 8192  # tokens computed per step (prefill chunking limit)
    block_size: int = 16  # tokens per KV block (FlashInfer page size)
    kv_cache_bytes: int | None = 4 * 1024**3  # KV budget; ignored when num_blocks is set
    num_blocks: int | None = None  # explicit block count (tests)
    cuda_graphs: bool = True  # decode and whole-step CUDA graphs (CUDA + FlashInfer); False: eager
    enable_prefix_caching: bool = True  # reuse K/V of cached full-block prompt prefixes
    # decode rows of other sequences in this KV pool a step may take beside its own
    # (`step(guests)`: a server's duplex sessions); the decode graphs cover them. A served
    # app sets it from duplex.max_sessions (deployments/config.py DERIVED_KEYS)
    max_guest_rows: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be >= 1")
        if self.max_guest_rows < 0:
            raise ValueError("max_guest_rows must be >= 0")
        if self.num_blocks is None and self.kv_cache_bytes is None:
            raise ValueError("set kv_cache_bytes or num_blocks")


@dataclass
class StepOutput:
    request_id: str
    token_ids: list[int]  # new ids of this step (empty for a plain abort notice)
    hidden: torch.Tensor | None  # (n, H) CPU: final-norm hidden of output tokens fed this step
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_hits: int  # prompt tokens taken from the prefix cache at admission
    prefix_cache_queries: int  # prompt tokens looked up at admission (the hit rate's base)
    num_cached_blocks: int  # blocks holding a cached prefix (in use or evictable)
    # Per-step work, the largest seen: prompt tokens of one step that fed running decodes,
    # and the most consecutive steps a decoding sequence (one with an output token to
    # feed) was left out of.
    max_step_prefill_tokens: int = 0
    max_decode_wait_steps: int = 0
    max_step_ms: float = 0.0  # the longest step() (wall time, device work included)
    # Pure-decode steps on CUDA (runner.DecodeTimes), cumulative: their GPU spans, and the
    # GPU's idle time before those launched with another in flight (the host was late)
    decode_gpu_steps: int = 0
    decode_gpu_ms: float = 0.0
    decode_idle_gaps: int = 0
    decode_idle_ms: float = 0.0
    max_decode_idle_ms: float = 0.0
    flashinfer_attention: int = 0  # 1: FlashInfer's paged attention, 0: torch's (`auto`: either)


class LLMEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        media_loader: MediaLoader | None = None,
    ) -> None:
        self.config = config
        self.media_loader = media_loader
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model
        cfg = model.cfg

        # ===== KV cache =====
        num_blocks = config.num_blocks or num_blocks_for_budget(
            cfg, config.block_size, dtype, config.kv_cache_bytes
        )
        self.kv_cache = KVCache(cfg, num_blocks, config.block_size, dtype, self.device)

        # ===== Scheduler =====
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )

        # ===== Attention backend, runner and its CUDA graphs =====
        self.backend = make_backend(
            self.device,
            num_qo_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            block_size=config.block_size,
            max_num_pages=num_blocks + 1,
            dtype=dtype,
        )
        self.flashinfer_attention = isinstance(self.backend, FlashInferAttention)
        graphs = None
        if config.cuda_graphs and self.device.type == "cuda" and self.flashinfer_attention:
            graphs = LLMGraphRunner.build(
                model, self.kv_cache, self.backend, config.max_num_seqs, dtype, self.device,
                config.max_guest_rows,
            )
        self.runner = ModelRunner(model, self.kv_cache, self.backend, self.device, dtype, graphs)
        # Plan and launch step N+1 before waiting for step N (tests set it on the CPU).
        self.launch_ahead = self.device.type == "cuda"
        self._inflight: tuple[StepPlan, LaunchedStep] | None = None  # launched, not returned
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[StepOutput] = []
        self._num_preemptions = 0
        self._decode_waits: dict[str, int] = {}  # steps since a decoding sequence's last token
        self._max_step_prefill = 0
        self._max_decode_wait = 0
        self._max_step_ms = 0.0

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.runner.graphs is not None

    # -- requests ----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        mm_positions: torch.Tensor | None = None,
        mm_embeds: torch.Tensor | None = None,
        return_hidden: bool = False,
        mm_spans: list[MediaSpan] | None = None,
        num_ready: int | None = None,
    ) -> None:
        """mm_positions / mm_embeds: rows replacing the token embeddings at those prompt
        positions. mm_spans: the content keys of those rows, which makes blocks holding
        them cacheable (without keys, caching stops at the first multimodal row). Every
        row lies in a span, and a span has all its rows or none: a span without rows is
        loaded through `media_loader` if a step has to compute it, unless it starts at or
        after `num_ready` (None: all). Positions from `num_ready` on wait for
        `supply_media`."""
        if request_id in self._seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not prompt_ids:
            raise ValueError("empty prompt")
        if (mm_positions is None) != (mm_embeds is None):
            raise ValueError("mm_positions and mm_embeds go together")
        if mm_positions is not None:
            mm_positions = mm_positions.to(torch.long).cpu()
            if mm_embeds.shape[0] != mm_positions.numel():
                raise ValueError(
                    f"{mm_positions.numel()} mm positions but {mm_embeds.shape[0]} embeds"
                )
            if mm_positions.numel() and (
                int(mm_positions.min()) < 0 or int(mm_positions.max()) >= len(prompt_ids)
            ):
                raise ValueError("mm_positions must index the prompt")
        spans = list(mm_spans or [])
        missing = self._check_spans(spans, mm_positions, len(prompt_ids))
        if num_ready is not None and num_ready < 0:
            raise ValueError(f"num_ready must be >= 0, got {num_ready}")
        ready = sys.maxsize if num_ready is None else num_ready
        if any(sp.start < ready for sp in missing) and self.media_loader is None:
            raise ValueError(f"{len(missing)} media spans have no rows and there is no loader")
        # A request that cannot fit even alone would preempt itself forever: refuse it now.
        need = self.block_manager.blocks_for(len(prompt_ids) + sampling.max_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"request {request_id!r} needs {need} KV blocks (prompt {len(prompt_ids)} + "
                f"max_tokens {sampling.max_tokens}), the cache has {self.block_manager.num_blocks}"
            )
        seq = Sequence(
            request_id,
            list(prompt_ids),
            sampling,
            mm_positions=mm_positions,
            mm_embeds=mm_embeds,
            return_hidden=return_hidden,
            generator=make_generator(sampling.seed, self.device),
            mm_spans=spans,
            mm_missing=missing,
            num_ready=ready,
        )
        if mm_positions is not None and mm_positions.numel() and not spans:
            seq.cacheable_until = int(mm_positions.min())
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    @staticmethod
    def _check_spans(
        spans: list[MediaSpan], positions: torch.Tensor | None, num_prompt: int
    ) -> list[MediaSpan]:
        """Validate `spans` against the rows given; return the spans without rows."""
        prev_end = 0
        for sp in spans:
            if not (prev_end <= sp.start < sp.end <= num_prompt) or not sp.key:
                raise ValueError(
                    f"media span [{sp.start}, {sp.end}) key {sp.key!r}: spans must be sorted, "
                    f"disjoint, non-empty, keyed and inside the prompt ({num_prompt} tokens)"
                )
            prev_end = sp.end
        if not spans:
            return []
        pos = torch.sort(positions).values if positions is not None else torch.zeros(0)
        missing, covered = [], 0
        for sp in spans:
            n = int(torch.searchsorted(pos, sp.end) - torch.searchsorted(pos, sp.start))
            if n == 0:
                missing.append(sp)
            elif n != sp.end - sp.start:
                raise ValueError(
                    f"media span [{sp.start}, {sp.end}) has {n} of its {sp.end - sp.start} rows"
                )
            covered += n
        if covered != pos.numel():
            raise ValueError(f"{pos.numel() - covered} multimodal rows lie outside every span")
        return missing

    def cached_prefix_len(
        self, prompt_ids: list[int], mm_spans: list[MediaSpan] | None = None
    ) -> int:
        """Prompt tokens that a request added now would take from the prefix cache (a
        whole number of blocks, less than the prompt). A hint: blocks may be evicted before
        the request is admitted."""
        if not self.config.enable_prefix_caching or not prompt_ids:
            return 0
        bs = self.config.block_size
        hashes: list[bytes] = []
        extend_hashes(hashes, prompt_ids, mm_spans or [], bs, (len(prompt_ids) - 1) // bs)
        return len(self.block_manager.match_prefix(hashes)) * bs

    def supply_media(
        self,
        request_id: str,
        spans: list[MediaSpan],
        rows: list[torch.Tensor],
        num_ready: int | None = None,
    ) -> None:
        """Rows of spans the request was added without (one (end - start, H) tensor per span),
        and how far its prompt is now ready (None: all of it)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"no request {request_id!r}")
        if any(sp not in seq.mm_missing for sp in spans):
            raise ValueError(f"request {request_id!r}: media spans supplied twice or not its own")
        if len(rows) != len(spans) or any(
            r.shape[0] != sp.end - sp.start for r, sp in zip(rows, spans)
        ):
            raise ValueError(f"request {request_id!r}: rows do not match the spans")
        ready = sys.maxsize if num_ready is None else max(num_ready, seq.num_ready)
        left = [sp for sp in seq.mm_missing if sp not in spans]
        if any(sp.start < ready for sp in left) and self.media_loader is None:
            raise ValueError(f"request {request_id!r}: spans before num_ready have no rows")
        if spans:
            self._merge_rows(seq, spans, rows)
        seq.num_ready = ready

    def abort(self, request_id: str) -> bool:
        """Free the request's blocks now; the next step() reports it finished ("abort")."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        del self._seqs[request_id]
        self._aborted.append(StepOutput(request_id, [], None, True, "abort"))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or self.in_flight

    @property
    def in_flight(self) -> bool:
        """A step was launched ahead and has not been returned yet."""
        return self._inflight is not None

    def run_guests(self, guests: GuestRows) -> None:
        """A decode step of `guests` alone (`step`'s), planning none of the engine's own:
        a step launched ahead stays in flight."""
        self.runner.run_guests(guests)

    def drain(self) -> list[StepOutput]:
        """The outputs of the step in flight (and abort notices), launching nothing: for a
        caller about to wait on the device for other work, so that these ids do not wait
        behind it."""
        outputs, self._aborted = self._aborted, []
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            outputs += self._complete(*launched)
        return outputs

    def has_decodes(self) -> bool:
        """A running request waits for its next token: the next step is on its clock."""
        return self.scheduler.has_decodes()

    # -- stepping ----------------------------------------------------------------------
    def step(self, guests: GuestRows | None = None) -> list[StepOutput]:
        """Plan and launch a step; return the outputs of the step that completes: this one,
        or, launching ahead, the one launched before it. `guests`: decode rows of sequences
        kept outside the engine in its KV pool, computed in this step's forward (in a
        decode step of their own when there is nothing to plan); their hidden rows and
        logits are on `guests` when it returns."""
        t0 = time.perf_counter()
        outputs, self._aborted = self._aborted, []
        plan = self.scheduler.schedule()
        self._num_preemptions += len(plan.preempted)
        self._track_waits(plan)
        launched = None
        if not plan.is_empty:
            for s in plan.seqs:
                if s.seq.mm_missing:
                    self._load_media(s)
            launched = (plan, self.runner.launch(plan, guests))
            self.scheduler.advance(plan)
        elif guests:
            self.runner.run_guests(guests)
        if self.launch_ahead:
            launched, self._inflight = self._inflight, launched
        if launched is not None:
            outputs += self._complete(*launched)
        self._max_step_ms = max(self._max_step_ms, 1e3 * (time.perf_counter() - t0))
        return outputs

    def _complete(self, plan: StepPlan, launched: LaunchedStep) -> list[StepOutput]:
        """Wait for a launched step's ids and hidden rows; its outputs. Rows of sequences
        that finished since it was planned are dropped."""
        result = self.runner.finish(launched, decode=plan.is_decode_only)
        outputs = []
        for up in self.scheduler.resolve(plan, result.sampled):
            seq = up.seq
            outputs.append(
                StepOutput(
                    seq.request_id,
                    [up.token_id],
                    result.hidden.pop(seq.request_id, None),
                    up.finished,
                    seq.finish_reason if up.finished else None,
                )
            )
            if up.finished:
                del self._seqs[seq.request_id]
        # Hidden rows of sequences that computed without sampling (recompute chunks).
        live = {s.seq.request_id: s.seq for s in plan.seqs if not s.seq.is_finished}
        for rid, h in result.hidden.items():
            if rid in live and self._seqs.get(rid) is live[rid]:
                outputs.append(StepOutput(rid, [], h, False, None))
        return outputs

    def _track_waits(self, plan: StepPlan) -> None:
        """Per-step work stats: prompt tokens of a step with decodes, and for every running
        sequence that has an output token to feed, how many steps in a row it was left out."""
        if any(s.is_decode for s in plan.seqs):
            prefill = sum(s.num_new for s in plan.seqs if s.num_new > 1)
            self._max_step_prefill = max(self._max_step_prefill, prefill)
        fed = {id(s.seq) for s in plan.seqs}
        waits: dict[str, int] = {}
        for seq in self.scheduler.running:
            if is_decoding(seq):  # scheduled or not
                w = 0 if id(seq) in fed else self._decode_waits.get(seq.request_id, 0) + 1
                waits[seq.request_id] = w
                self._max_decode_wait = max(self._max_decode_wait, w)
        self._decode_waits = waits

    def _load_media(self, s: ScheduledSeq) -> None:
        """Rows of the spans this step computes that the request left out (its cached
        prefix was evicted, or it was preempted): loaded with every later missing span."""
        seq = s.seq
        hi = s.start + s.num_new
        # Spans from num_ready on are not the loader's: their rows come by supply_media.
        need = [sp for sp in seq.mm_missing if sp.end > s.start and sp.start < seq.num_ready]
        if not any(sp.start < hi for sp in need):
            return
        rows = self.media_loader(seq.request_id, need)
        if len(rows) != len(need) or any(
            r.shape[0] != sp.end - sp.start for r, sp in zip(rows, need)
        ):
            raise RuntimeError(f"media loader gave the wrong rows for {seq.request_id!r}")
        self._merge_rows(seq, need, rows)

    @staticmethod
    def _merge_rows(seq: Sequence, spans: list[MediaSpan], rows: list[torch.Tensor]) -> None:
        """Put the rows of `spans` (missing until now) into the sequence's multimodal rows,
        on the device they already are (encoder outputs stay where the encoder left them)."""
        pos = torch.cat([torch.arange(sp.start, sp.end) for sp in spans])
        dev = rows[0].device if seq.mm_embeds is None else seq.mm_embeds.device
        emb = torch.cat([r.to(dev) for r in rows])
        if seq.mm_positions is not None:
            pos = torch.cat([seq.mm_positions, pos])
            emb = torch.cat([seq.mm_embeds, emb.to(seq.mm_embeds.dtype)])
        order = torch.argsort(pos)
        seq.mm_positions, seq.mm_embeds = pos[order], emb[order.to(emb.device)]
        done = set(spans)
        seq.mm_missing = [sp for sp in seq.mm_missing if sp not in done]

    def stats(self) -> EngineStats:
        t = self.runner.decode_times
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.block_manager.num_free,
            num_total_blocks=self.block_manager.num_blocks,
            num_preemptions=self._num_preemptions,
            prefix_cache_hits=self.scheduler.num_prefix_hits,
            prefix_cache_queries=self.scheduler.num_prefix_queries,
            num_cached_blocks=self.block_manager.num_cached,
            max_step_prefill_tokens=self._max_step_prefill,
            max_decode_wait_steps=self._max_decode_wait,
            max_step_ms=self._max_step_ms,
            decode_gpu_steps=t.steps,
            decode_gpu_ms=t.gpu_ms,
            decode_idle_gaps=t.gaps,
            decode_idle_ms=t.idle_ms,
            max_decode_idle_ms=t.max_idle_ms,
            flashinfer_attention=int(self.flashinfer_attention),
        )

    def generate(
        self, prompts: dict[str, list[int]], sampling: SamplingParams
    ) -> dict[str, list[int]]:
        """Convenience for tests and benchmarks: run prompts to completion."""
        for rid, ids in prompts.items():
            self.add_request(rid, ids, sampling)
        out: dict[str, list[int]] = {rid: [] for rid in prompts}
        while self.has_unfinished():
            for o in self.step():
                out[o.request_id] += o.token_ids
        return out
