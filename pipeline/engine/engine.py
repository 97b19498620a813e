"""LLMEngine: a synchronous, single-threaded continuous-batching engine over one model.

    engine = LLMEngine(model, EngineConfig(...), device, dtype)
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step(): ...

Construction, in order: KV cache (sized from a byte budget or a block count) ->
block manager + scheduler -> attention backend -> runner (+ CUDA graphs when enabled).
The caller (a deployment) drives `step()` in a loop; nothing here blocks or spawns threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.engine.attention import FlashInferAttention, make_backend
from pipeline.engine.graphs import DecodeGraphs, default_graph_sizes
from pipeline.engine.kv_cache import BlockManager, KVCache, num_blocks_for_budget
from pipeline.engine.runner import ModelRunner
from pipeline.engine.sampling import make_generator
from pipeline.engine.scheduler import Scheduler, Sequence
from pipeline.handoff import SamplingParams


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8  # running sequences per step
    max_num_batched_tokens: int = 8192  # tokens computed per step (prefill chunking limit)
    block_size: int = 16  # tokens per KV block (FlashInfer page size)
    kv_cache_bytes: int | None = 4 * 1024**3  # KV budget; ignored when num_blocks is set
    num_blocks: int | None = None  # explicit block count (tests)
    attention_backend: str = "auto"  # "torch" | "flashinfer" | "auto"
    cuda_graphs: bool = True  # capture decode graphs (CUDA + flashinfer only)
    graph_batch_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, 8, 16, 32, ... max_num_seqs

    def __post_init__(self) -> None:
        if self.attention_backend not in ("torch", "flashinfer", "auto"):
            raise ValueError(
                f"attention_backend must be torch|flashinfer|auto, got {self.attention_backend!r}"
            )
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be >= 1")
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


class LLMEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
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
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )

        # ===== Attention backend =====
        self.backend = make_backend(
            config.attention_backend,
            num_qo_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            block_size=config.block_size,
            max_num_pages=num_blocks + 1,
            dtype=dtype,
            device=self.device,
        )

        # ===== CUDA graphs (decode only) =====
        graphs = None
        if (
            config.cuda_graphs
            and self.device.type == "cuda"
            and isinstance(self.backend, FlashInferAttention)
        ):
            sizes = config.graph_batch_sizes or default_graph_sizes(config.max_num_seqs)
            graphs = DecodeGraphs(
                model, self.kv_cache, self.backend, sizes, cfg.head_dim**-0.5, dtype, self.device
            )
            graphs.capture()
        self.runner = ModelRunner(model, self.kv_cache, self.backend, self.device, dtype, graphs)

        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[StepOutput] = []
        self._num_preemptions = 0

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
    ) -> None:
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
        )
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Free the request's blocks now; the next step() reports it finished ("abort")."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        del self._seqs[request_id]
        self._aborted.append(StepOutput(request_id, [], None, True, "abort"))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # -- stepping ----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs, self._aborted = self._aborted, []
        plan = self.scheduler.schedule()
        self._num_preemptions += len(plan.preempted)
        if plan.is_empty:
            return outputs
        result = self.runner.run(plan)
        for up in self.scheduler.postprocess(plan, result.sampled):
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
        for rid, h in result.hidden.items():
            outputs.append(StepOutput(rid, [], h, False, None))
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.block_manager.num_free,
            num_total_blocks=self.block_manager.num_blocks,
            num_preemptions=self._num_preemptions,
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
