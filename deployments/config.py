"""The application's settings: what `serve_config.yaml` passes as `args` to `build_app`.

Three layers (ARCHITECTURE.md): the checkpoint's config.json is read by the stages
themselves; each stage's `engine:` dict is validated against that stage's frozen engine
config when the stage starts; this module holds the Serve concerns (GPU fractions, memory
caps, replicas, concurrency) and the app-wide knobs, validated here with clear errors.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GIB = 1024**3


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _switch_interval(why: str) -> Any:
    return Field(None, gt=0.0, le=100.0, description=(
        "the replica's GIL switch interval (sys.setswitchinterval; null = Python's 5 ms): a "
        "thread that gave the GIL up (to FFmpeg, to a GPU wait) waits up to one interval to "
        f"take it back while another thread runs Python; {why}. Thread scheduling only: the "
        "same outputs"))


class StageSettings(_Settings):
    """One model deployment (Thinker, Talker or Code2Wav)."""

    num_gpus: float = Field(0.0, ge=0.0, le=1.0, description=(
        "Ray GPU fraction; applied only when the cluster has GPUs (fractions schedule, "
        "they do not limit memory)"))
    memory_fraction: float | None = Field(None, gt=0.0, le=1.0, description=(
        "torch.cuda.set_per_process_memory_fraction for this stage; the startup check "
        "proves that all stages' fractions plus CUDA contexts fit the device"))
    graph_reserve_gib: float = Field(0.0, ge=0.0, description=(
        "memory outside the cap for CUDA graph pools / workspaces, counted by the check"))
    kv_cache_gib: float | None = Field(None, gt=0.0, description=(
        "KV-cache budget on GPU (Thinker); null = the engine's default"))
    cpu_kv_cache_gib: float = Field(0.0625, gt=0.0, description=(
        "KV-cache budget when the stage runs on CPU, so one config serves both"))
    num_cpus: float = Field(0.0, ge=0.0)
    max_ongoing_requests: int = Field(256, ge=1)
    num_replicas: int = Field(1, ge=1, le=1, description=(
        "one replica per stage: a turn's stream state lives in one process (several "
        "replicas per GPU stage come with stage groups)"))
    health_check_period_s: float = Field(5.0, gt=0, description=(
        "how often Serve calls the stage's check_health (a wedged engine loop fails it)"))
    health_check_timeout_s: float = Field(30.0, gt=0)
    engine: dict[str, Any] = Field(default_factory=dict, description=(
        "fields of the stage's frozen engine config (batch limits, knobs); unknown keys "
        "fail the stage at startup"))
    mps_thread_percentage: int | None = Field(None, ge=1, le=100, strict=True, description=(
        "gpu_sharing: mps only: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of this stage's replica "
        "(a cap on its share of the SMs; caps may add up to more than 100); null = the MPS "
        "daemon's default"))
    cuda_stream_priority: Literal["default", "high"] = Field("default", description=(
        "high: the engine thread's commands and steps, and the CUDA graphs it captures, run "
        "on a high-priority CUDA stream (the same kernels in the same order, so the same "
        "output); priorities order work the GPU runs at the same time, which between "
        "processes happens only under MPS; ignored on CPU"))
    switch_interval_ms: float | None = _switch_interval(
        "its engine thread takes it back after each wait for the GPU, beside the event loop "
        "that forwards the engine's outputs")


class IngressSettings(_Settings):
    num_cpus: float = Field(0.0, ge=0.0)
    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(1024, ge=1)
    prefetch_frames: bool = Field(True, description=(
        "a video's frames go to the Thinker's vision encoder as they are decoded, before the "
        "request is built (same output; with several groups, to the group a turn would be "
        "routed to at that moment): 8 at a time while the video still decodes when this "
        "replica builds no other request, else all at once while the request's audio (its "
        "track or another part) still decodes; an audio part's clip goes to the audio "
        "encoder the same way, while another part still decodes. On an H200 at c=1, 30 s "
        "clips with their audio as a part of their own: TTFT 259 against 300 ms, first "
        "audio 484 against 530 (frames only); clips with their own audio track: TTFT 266 "
        "against 331"))
    switch_interval_ms: float | None = _switch_interval(
        "its media decode threads take the GIL back after every FFmpeg call: on the "
        "development box a 30 s clip's decode beside a busy Python thread takes 2.1 s at "
        "5 ms, 0.28 s at 0.5 ms, 63 ms alone (`python -m bench.gil_decode`)")


class RealtimeSettings(_Settings):
    """`WS /v1/realtime` sessions (docs/api.md "Realtime"): each lives in the ingress replica
    that accepted its socket."""

    max_sessions: int = Field(16, ge=0, description=(
        "open sessions per ingress replica; past it a new socket gets an error event "
        "(session_limit_reached) and is closed"))
    idle_timeout_s: float = Field(600.0, gt=0, description=(
        "a session with no client event for this long is closed"))
    max_event_bytes: int = Field(4 * 1024 * 1024, ge=1024, description=(
        "one client event's JSON text"))
    max_buffer_s: float = Field(120.0, gt=0, description=(
        "uncommitted input audio; past it appends are refused (server VAD commits a "
        "speech turn that long as it is)"))
    max_items: int = Field(256, ge=2, description="conversation items per session")


class LimitSettings(_Settings):
    """Input limits (pipeline.processing.MediaLimits) plus request-level ones."""

    max_media_bytes: int = Field(64 * 1024 * 1024, ge=1)
    max_image_pixels: int = Field(4096 * 4096, ge=1)
    max_image_aspect_ratio: float = Field(200.0, ge=1.0, description=(
        "longest side / shortest side of an image or video frame; beyond it the slicing "
        "rules stop bounding the patch grid"))
    max_images: int = Field(128, ge=1)
    max_video_frames: int = Field(64, ge=1)
    max_video_seconds: float = Field(600.0, gt=0)
    max_audio_seconds: float = Field(600.0, gt=0)
    max_prompt_tokens: int = Field(32768, ge=1)
    max_tokens: int = Field(4096, ge=1, description="upper bound on a request's max_tokens")
    default_max_tokens: int = Field(512, ge=1)
    max_body_bytes: int = Field(256 * 1024 * 1024, ge=1)
    max_json_depth: int = Field(64, ge=4, description="nesting depth of a request body, checked before parsing")
    max_ref_audio_seconds: float = Field(30.0, gt=0)
    max_voices: int = Field(64, ge=1, description="stored voices (POST /v1/audio/voices)")
    media_cache_bytes: int = Field(512 * 1024**2, ge=0, description=(
        "processed media (image slices, audio features, a video's frames and segments) kept "
        "by content hash, so a follow-up turn re-sending the same media skips decoding it; "
        "LRU by tensor bytes; 0 = off"))


class TimeoutSettings(_Settings):
    """Deadlines of the calls between stages. A stage that dies ends its turns at once (its
    streams fail); these bound a stage that is alive but does not answer."""

    open_s: float = Field(30.0, gt=0, description=(
        "a speech stage opening a turn's stream (a reference voice's prompt included)"))
    hop_s: float = Field(30.0, gt=0, description="one stage-to-stage call (feed / push)")
    heartbeat_s: float = Field(1.0, gt=0, description=(
        "an open stage stream sends a heartbeat after this long without output"))
    stall_s: float = Field(10.0, gt=0, description=(
        "a stage stream silent this long (no output, no heartbeat) ends its turn"))
    wedge_s: float = Field(120.0, gt=0, description=(
        "one engine step or command running this long marks the stage unhealthy"))
    abort_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _heartbeats_beat_stalls(self) -> TimeoutSettings:
        if self.heartbeat_s * 2 > self.stall_s:
            raise ValueError(f"timeouts.stall_s ({self.stall_s:g}) must be at least twice "
                             f"timeouts.heartbeat_s ({self.heartbeat_s:g})")
        return self


# The single-GPU split, per stage (memory fractions that fit an 80 GB GPU as well as the
# H200: Code2Wav's engine alone peaked at 19.3 GiB at 8 chunks a step, its slot pool 8.5, and
# ran out of the 14.3 GiB that 0.18 of an H100 gave it while warming up).
STAGE_DEFAULTS: dict[str, dict[str, Any]] = {
    # The engine configs' own defaults are the plain reference path (what the parity tests
    # compare against); the app ships the fast paths on top (serve_config.yaml says the
    # same, and a test holds the two equal). The Thinker's piecewise and prefill graphs (CUDA
    # only; bitwise the eager hidden rows at full size) and audio graphs (bf16 rounding), and
    # the Talker's fused forward and padded prefills reorder bf16 sums (same greedy tokens at
    # full size; the Talker ~1.5 ulps of the logits, flat over 300 codes; compiled only on CUDA).
    "thinker": {"num_gpus": 0.55, "memory_fraction": 0.5, "engine": {
        "audio_cuda_graphs": True, "fused_qk_rope_kv": True,
        "llm": {"piecewise_graph_tokens": 512, "prefill_graph_tokens": 512}}},
    "talker": {"num_gpus": 0.15, "memory_fraction": 0.1, "engine": {
        "talker_fused": True, "talker_compile": True, "prefill_graphs": True,
        "talker_rope_kernel": True}},
    "code2wav": {"num_gpus": 0.2, "memory_fraction": 0.28, "engine": {
        "token2wav_slot_pool": True, "token2wav_cfm_cuda_graph": True,
        "token2wav_compile_estimator": True, "token2wav_hift_cuda_graph": True,
        "token2wav_vocoder_gemm_convs": True, "token2wav_dit_split_matmuls": True,
        "token2wav_dit_pool_attention": True, "token2wav_vocoder_fused_snakes": True,
        "token2wav_vocoder_window_kernel": True, "token2wav_dit_tails_in_post": True,
        "token2wav_dit_kv_write_kernel": True, "token2wav_vocoder_fused_biases": True,
        "token2wav_vocoder_frame_major": True}},
}


def _stage_defaults(stage: str) -> StageSettings:
    """A stage's settings with nothing given: its own copy of the nested defaults."""
    return StageSettings(**copy.deepcopy(STAGE_DEFAULTS[stage]))


def _merged(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """`given` over `defaults`, nested dicts merged key by key (a partial `engine:` keeps
    the other defaults)."""
    out = copy.deepcopy(defaults)
    for k, v in given.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class AppConfig(_Settings):
    """Everything `build_app(args)` accepts (see serve_config.yaml for a commented copy)."""

    name: str = Field("omniray", description="model name in /v1/models and responses")
    model: str | None = Field(None, description=(
        "checkpoint directory; null or 'tiny' = the embedded tiny default, "
        "'random-full' = full-size random weights"))
    device: Literal["auto", "cpu", "cuda"] = "auto"
    active_stream_window: int = Field(4, ge=0, description=(
        "K turns in one group's GPU stages; 0 = no limit"))
    groups: int | Literal["auto"] = Field(1, description=(
        "stage groups: one replica of each stage on one GPU, every hop of a turn inside its "
        "group; auto = one per GPU in the cluster (1 without GPUs)"))
    max_groups: int | Literal["auto"] | None = Field(None, description=(
        "autoscaled groups: bind this many (auto = one per GPU), keep min_groups running, "
        "and start the others when every running group's window is full and turns wait; "
        "null = exactly `groups`"))
    min_groups: int = Field(1, ge=1, description="autoscaled groups that always run")
    group_idle_s: float = Field(120.0, gt=0, description=(
        "an autoscaled group past min_groups with no turn for this long gets no new turns, "
        "and Serve stops its replicas group_idle_s later (its GPU stays reserved)"))
    talker_mode: Literal["streaming", "full_span"] = Field("streaming", description=(
        "streaming: the Talker starts on the first spoken chunk; full_span: it waits for "
        "the whole spoken span (the offline reference behaviour)"))
    hold_for_first_audio: bool = Field(True, description=(
        "a speech turn's Thinker decode (once the Talker has its first text chunk) and Talker "
        "decode (once its first code chunk is out) run only beside other work until the "
        "turn's first audio is out (at most 0.25 s): on the GPU the stages share, they would "
        "slow the stages making it; the same outputs (streaming talker_mode only)"))
    request_timeout_s: float = Field(600.0, gt=0)
    allowed_local_media_path: str | None = Field(None, description=(
        "file:// media is read only under this folder; null = no local files"))
    allowed_media_hosts: list[str] = Field(default_factory=list, description=(
        "http(s) hosts the ingress may fetch media from; empty = no fetches"))
    allowed_media_networks: list[str] = Field(default_factory=list, description=(
        "CIDRs that allowed hosts may resolve to although loopback / private / link-local "
        "(fetches to such addresses are refused otherwise)"))
    special_tokens_in_text: bool = Field(False, description=(
        "tokenize special tokens typed in message text as control tokens (trusted clients "
        "only); false = they are plain text"))
    stream_format: Literal["openai", "vllm-omni"] = Field("openai", description=(
        "streamed audio shape: openai = delta.audio {id, data, transcript, expires_at}; "
        "vllm-omni = delta.content tagged by a top-level modality; a request's "
        "omniray.stream_format overrides it"))
    voices_dir: str | None = Field(None, description=(
        "where uploaded voices (POST /v1/audio/voices) are kept and restored from at start; "
        "null = <OMNIRAY_CACHE, default ~/.cache/omniray>/voices"))
    cuda_context_gib: float = Field(0.7, ge=0.0, description="per-process CUDA context estimate")
    gpu_sharing: Literal["timeslice", "mps"] = Field("timeslice", description=(
        "how the stages' processes share a GPU: timeslice = the driver's default (one "
        "process's kernels at a time); mps = through an MPS daemon the operator started "
        "(kernels of several stages at once), with each stage's mps_thread_percentage; "
        "each GPU stage reports at start what it actually found"))
    stage_start: Literal["serial", "parallel"] = Field("parallel", description=(
        "how a GPU's stages start: parallel = a per-GPU lock held for each stage's memory "
        "check and cap alone, the builds and warm-ups (compiles, CUDA graph captures, "
        "FlashInfer's JIT) side by side (a check may then read memory another stage is "
        "still filling; each stage stays under its cap either way); serial = one at a "
        "time, each built and warmed up under the lock, so each memory check reads the "
        "GPU with the stages before it done (a longer start: 78 against 48.5 s on an H100)"))
    stage_transport: Literal["grpc", "ray"] = Field("grpc", description=(
        "how a turn's calls between the ingress and the stages, and between the stages, "
        "travel: grpc = Serve's gRPC data plane between replicas (a small call or streamed "
        "item in about half the time); ray = Ray actor calls (Serve's default). Calls "
        "carrying media or other arrays over 2 MiB go as actor calls either way (the object "
        "store hands them over without a copy; a replica's gRPC messages stop at 4 MiB)"))
    limits: LimitSettings = Field(default_factory=LimitSettings)
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    ingress: IngressSettings = Field(default_factory=IngressSettings)
    realtime: RealtimeSettings = Field(default_factory=RealtimeSettings)
    thinker: StageSettings = Field(default_factory=lambda: _stage_defaults("thinker"))
    talker: StageSettings = Field(default_factory=lambda: _stage_defaults("talker"))
    code2wav: StageSettings = Field(default_factory=lambda: _stage_defaults("code2wav"))

    @model_validator(mode="before")
    @classmethod
    def _stage_defaults(cls, data: Any) -> Any:
        """A partial stage section keeps that stage's single-GPU defaults for the keys it
        leaves out (`thinker: {engine: ...}` must not silently drop the GPU fraction)."""
        if isinstance(data, dict):
            data = dict(data)
            for name, defaults in STAGE_DEFAULTS.items():
                if isinstance(data.get(name), dict):
                    data[name] = _merged(defaults, data[name])
        return data

    @model_validator(mode="after")
    def _groups_valid(self) -> AppConfig:
        if isinstance(self.groups, int) and self.groups < 1:
            raise ValueError(f"groups must be >= 1 or 'auto', got {self.groups}")
        if self.max_groups is not None:
            if self.groups != 1:
                raise ValueError("set either groups or min_groups / max_groups, not both")
            if isinstance(self.max_groups, int) and self.max_groups < self.min_groups:
                raise ValueError(f"max_groups ({self.max_groups}) must be at least "
                                 f"min_groups ({self.min_groups})")
        n = self.ingress.num_replicas
        if 0 < self.active_stream_window < n:
            raise ValueError(f"active_stream_window ({self.active_stream_window}) must be at "
                             f"least ingress.num_replicas ({n}): each ingress replica admits "
                             f"its share of every group's window")
        return self

    @property
    def autoscaled(self) -> bool:
        return self.max_groups is not None

    def window_per_ingress(self) -> int:
        """One ingress replica's share of each group's window, so that all replicas together
        never put more than `active_stream_window` turns in a group (0 = no limit)."""
        return self.active_stream_window // self.ingress.num_replicas

    @model_validator(mode="after")
    def _fractions_fit(self) -> AppConfig:
        gpus = self.thinker.num_gpus + self.talker.num_gpus + self.code2wav.num_gpus
        if gpus > 1.0 + 1e-9:
            raise ValueError(f"stage num_gpus add up to {gpus:.2f} > 1 GPU")
        caps = [s.memory_fraction or 0.0 for s in self.stages().values()]
        if sum(caps) > 1.0:
            raise ValueError(f"stage memory_fraction values add up to {sum(caps):.2f} > 1.0")
        if self.gpu_sharing != "mps":
            for name, s in self.stages().items():
                if s.mps_thread_percentage is not None:
                    raise ValueError(
                        f"{name}.mps_thread_percentage is {s.mps_thread_percentage} but "
                        f"gpu_sharing is {self.gpu_sharing!r}; set gpu_sharing: mps or leave "
                        f"the percentage out")
        return self

    def stages(self) -> dict[str, StageSettings]:
        return {"thinker": self.thinker, "talker": self.talker, "code2wav": self.code2wav}


class MemoryBudgetError(RuntimeError):
    """The stages' memory caps plus CUDA contexts and graph reserves do not fit the GPU."""


def check_memory_budget(cfg: AppConfig, total_bytes: int, *, free_bytes: int | None = None,
                        stage: str | None = None) -> dict[str, float]:
    """Prove that every stage's cap + one CUDA context each + graph reserves fit the device.

    When `stage` and `free_bytes` are given, also check that this stage's own cap fits in
    what is free right now (one stage's check at a time: with `stage_start: serial` the
    stages before it are built; in parallel another may still be filling its cap, which the
    plan above leaves room for).
    Returns the plan in GiB; raises MemoryBudgetError with the numbers otherwise.
    """
    total = total_bytes / GIB
    plan = {name: (s.memory_fraction or 0.0) * total for name, s in cfg.stages().items()}
    contexts = cfg.cuda_context_gib * len(plan)
    graphs = sum(s.graph_reserve_gib for s in cfg.stages().values())
    need = sum(plan.values()) + contexts + graphs
    detail = ", ".join(f"{k} {v:.2f}" for k, v in plan.items())
    if need > total:
        raise MemoryBudgetError(
            f"GPU memory budget does not fit: caps ({detail}) + {len(plan)} CUDA contexts "
            f"{contexts:.2f} + graph reserves {graphs:.2f} = {need:.2f} GiB > device "
            f"{total:.2f} GiB; lower the stages' memory_fraction")
    if stage is not None and free_bytes is not None:
        mine = plan[stage] + cfg.stages()[stage].graph_reserve_gib
        free = free_bytes / GIB
        if mine > free:
            raise MemoryBudgetError(
                f"{stage}: needs {mine:.2f} GiB (cap {plan[stage]:.2f} + graph reserve "
                f"{cfg.stages()[stage].graph_reserve_gib:.2f}) but only {free:.2f} GiB of "
                f"{total:.2f} GiB is free")
    return {**plan, "contexts": contexts, "graphs": graphs, "total": total, "need": need}
