"""The application's settings: what `serve_config.yaml` passes as `args` to `build_app`.

Three layers (ARCHITECTURE.md): the checkpoint's config.json is read by the stages
themselves; each stage's `engine:` dict holds fields of that stage's frozen engine config
over its defaults (which are the shipped path), validated when the app is built and again
when the stage starts; this module holds the Serve concerns (GPU fractions, memory caps,
replicas, capacity) and the app-wide settings, each default in one place, validated here
with clear errors. serve_config.yaml lists the ones an operator tunes, at these defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GIB = 1024**3


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
        "fields of the stage's frozen engine config over its defaults; unknown keys fail "
        "the app at build (its slot count comes from `capacity`)"))


class IngressSettings(_Settings):
    num_cpus: float = Field(0.0, ge=0.0)
    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(1024, ge=1)


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


class DuplexSettings(_Settings):
    """Full-duplex sessions on `WS /v1/realtime?mode=audio|video` and `?duplex=1` (docs/api.md
    "Full duplex"): each lives in the ingress replica that accepted its socket."""

    max_sessions: int = Field(4, ge=0, description=(
        "duplex sessions running at once per ingress replica, at most: fewer when the "
        "Thinkers' KV pools hold fewer beside the window's chat turns (each session at its "
        "sliding window's bound); 0 = off"))
    max_queue: int = Field(16, ge=0, description=(
        "sessions waiting for a slot (each told its position and ETA, session.queued); "
        "past it a new socket gets an error event (server_busy) and close 1013"))
    queue_timeout_s: float = Field(300.0, gt=0, description=(
        "a queued session waiting longer is refused as past the queue"))
    idle_timeout_s: float = Field(60.0, gt=0, description=(
        "a session with no client event for this long is closed (the official demo's "
        "pause timeout: a paused client sends nothing)"))
    max_session_s: float = Field(3600.0, gt=0, description="a session's longest life")
    max_ahead_s: float = Field(10.0, gt=0, description=(
        "input audio past real time (seconds received minus seconds since the session "
        "started), and input waiting for the model; more ends the session: duplex input "
        "is a live stream"))
    max_outbound_bytes: int = Field(16 * 1024 * 1024, ge=64 * 1024, description=(
        "server events queued for a client that does not read them; past it the session "
        "ends (client_too_slow)"))
    max_event_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024, description=(
        "one client event's JSON text (a 1 s unit of audio and a camera frame)"))
    n_timesteps: int = Field(5, ge=1, le=50, description=(
        "Token2Wav's Euler steps for the sessions' speech: 5 as the official demo runs duplex "
        "(its example's `n_timesteps=5`, its server's Token2wav), 10 as `MiniCPMODuplex` "
        "does when not told (the turn-based Code2Wav's default); both match the reference "
        "in that mode"))
    token2wav_precision: Literal["fp32", "fp16"] = Field("fp32", description=(
        "the sessions' Token2Wav: fp32 as the reference computes by default; fp16 is the "
        "reference's own `enable_float16` (Token2wav(float16=True)): half the slot memory, "
        "the flow's matmuls on fp16 tensor cores, other audio"))


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
    max_ref_audio_seconds: float = Field(10.0, gt=0, description=(
        "ref_audio and stored voices; at most what a Code2Wav slot holds "
        "(code2wav.engine.slot_prompt_frames, 50 mel frames a second)"))
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


# Each stage's Serve side on one GPU: its share of the GPU, its memory cap (fractions that
# fit an 80 GB GPU with one CUDA context each and the graph reserves), and for the Thinker
# its KV budget. A stage section in the YAML overrides these key by key.
STAGE_DEFAULTS: dict[str, dict[str, Any]] = {
    "thinker": {"num_gpus": 0.55, "memory_fraction": 0.55, "graph_reserve_gib": 2.0,
                "kv_cache_gib": 16.0},
    "talker": {"num_gpus": 0.15, "memory_fraction": 0.1, "graph_reserve_gib": 1.0,
               "max_ongoing_requests": 1024},
    "code2wav": {"num_gpus": 0.2, "memory_fraction": 0.23, "graph_reserve_gib": 1.0,
                 "max_ongoing_requests": 1024},
}

# Engine-config fields that follow from an app setting, never set in an `engine:` section:
# (stage, keys, the setting). Each stage's slot count follows `capacity`; the Thinker's
# decode graphs also take the decode rows of the duplex sessions every ingress replica runs
# (pipeline.thinker.llm_engine.runner.GuestRows).
DERIVED_KEYS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("thinker", ("llm", "max_num_seqs"), "capacity"),
    ("talker", ("max_streams",), "capacity"),
    ("code2wav", ("max_streams",), "capacity"),
    ("thinker", ("llm", "max_guest_rows"), "duplex.max_sessions"))


# The released checkpoint's hub id: what vLLM-Omni serves it as (`vllm serve
# openbmb/MiniCPM-o-4_5 --omni`) and what its clients send as `model`.
OFFICIAL_MODEL_NAME = "openbmb/MiniCPM-o-4_5"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def checkpoint_model_name(model: str | None, hf_config: dict[str, Any]) -> str:
    """The checkpoint's own name. The embedded default and `random-full` are the released
    layout: the official hub id. A folder: its hub id when it is a Hugging Face cache
    snapshot (`models--ORG--NAME/snapshots/REV`), else config.json's `_name_or_path` when
    that is a hub id, else the official hub id (the checkpoint loaded in its layout)."""
    if model in (None, "", "tiny", "random-full"):
        return OFFICIAL_MODEL_NAME
    parts = Path(model).expanduser().parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            org_name = part[len("models--"):].split("--", 1)
            if len(org_name) == 2 and _HUB_ID.fullmatch("/".join(org_name)):
                return "/".join(org_name)
    named = hf_config.get("_name_or_path")
    if isinstance(named, str) and _HUB_ID.fullmatch(named) and not Path(named).exists():
        return named
    return OFFICIAL_MODEL_NAME


def _stage_defaults(stage: str) -> StageSettings:
    return StageSettings(**STAGE_DEFAULTS[stage])


class AppConfig(_Settings):
    """Everything `build_app(args)` accepts (see serve_config.yaml for a commented copy)."""

    name: str = Field("omniray", description=(
        "model name in /v1/models and responses; the checkpoint's own name "
        "(served_model_names) is served beside it"))
    model: str | None = Field(None, description=(
        "checkpoint directory; null or 'tiny' = the embedded tiny default, "
        "'random-full' = full-size random weights"))
    device: Literal["auto", "cpu", "cuda"] = "auto"
    capacity: int = Field(8, ge=1, description=(
        "turns one group runs at once: the ingress's window (split over its replicas) and "
        "every stage's slot count (Thinker max_num_seqs, Talker and Code2Wav max_streams) "
        "follow from it; a turn beyond it waits for a slot (at most 4 x capacity wait; "
        "past that a 503 with Retry-After). Each stage measures the turns its memory "
        "holds once built and refuses to start when that is fewer"))
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
    stage_transport: Literal["grpc", "ray"] = Field("grpc", description=(
        "how a turn's calls between the ingress and the stages, and between the stages, "
        "travel: grpc = Serve's gRPC data plane between replicas (no Ray task, no object "
        "store: a small call or streamed item is faster); ray = Ray actor calls (Serve's "
        "default). Calls carrying media or other arrays over 2 MiB go as actor calls either "
        "way (the object store hands them over without a copy; a replica's gRPC messages "
        "stop at 4 MiB)"))
    limits: LimitSettings = Field(default_factory=LimitSettings)
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    ingress: IngressSettings = Field(default_factory=IngressSettings)
    realtime: RealtimeSettings = Field(default_factory=RealtimeSettings)
    duplex: DuplexSettings = Field(default_factory=DuplexSettings)
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
                    data[name] = {**defaults, **data[name]}
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
        if self.capacity < n:
            raise ValueError(f"capacity ({self.capacity}) must be at least "
                             f"ingress.num_replicas ({n}): each ingress replica admits its "
                             f"share of every group's window")
        for stage, keys, setting in DERIVED_KEYS:
            section = self.stages()[stage].engine
            for k in keys[:-1]:
                section = section.get(k) or {}
            if keys[-1] in section:
                raise ValueError(f"{stage}.engine.{'.'.join(keys)} follows from {setting}: "
                                 f"set {setting} instead")
        return self

    def served_model_names(self, hf_config: dict[str, Any] | None = None) -> list[str]:
        """The names `/v1/models` lists and requests may give as `model`: `name`, then the
        checkpoint's own name (checkpoint_model_name), as vLLM's `--served-model-name`
        takes several. hf_config: the checkpoint's config.json."""
        own = checkpoint_model_name(self.model, hf_config or {})
        return [self.name] if own == self.name else [self.name, own]

    @property
    def autoscaled(self) -> bool:
        return self.max_groups is not None

    def window_per_ingress(self) -> int:
        """One ingress replica's share of each group's window, so that all replicas together
        never put more than `capacity` turns in a group."""
        return self.capacity // self.ingress.num_replicas

    def engine_settings(self, stage: str) -> dict[str, Any]:
        """`stage`'s `engine:` section with the fields that follow from app settings
        (DERIVED_KEYS)."""
        values = {"capacity": self.capacity,
                  "duplex.max_sessions": self.duplex.max_sessions * self.ingress.num_replicas}
        engine = copy.deepcopy(self.stages()[stage].engine)
        for owner, (*path, key), setting in DERIVED_KEYS:
            if owner != stage:
                continue
            section = engine
            for k in path:
                section = section.setdefault(k, {})
            section[key] = values[setting]
        return engine

    @model_validator(mode="after")
    def _fractions_fit(self) -> AppConfig:
        gpus = self.thinker.num_gpus + self.talker.num_gpus + self.code2wav.num_gpus
        if gpus > 1.0 + 1e-9:
            raise ValueError(f"stage num_gpus add up to {gpus:.2f} > 1 GPU")
        caps = [s.memory_fraction or 0.0 for s in self.stages().values()]
        if sum(caps) > 1.0:
            raise ValueError(f"stage memory_fraction values add up to {sum(caps):.2f} > 1.0")
        return self

    @model_validator(mode="after")
    def _voices_fit_a_slot(self) -> AppConfig:
        # a voice prompt's mel is 50 frames a second (24 kHz, hop 480); Code2Wav's slots hold
        # slot_prompt_frames of it (500 by default) and refuse a longer voice at open
        frames = self.code2wav.engine.get("slot_prompt_frames", 500)
        if self.limits.max_ref_audio_seconds * 50 > frames:
            raise ValueError(
                f"limits.max_ref_audio_seconds ({self.limits.max_ref_audio_seconds:g}) is longer "
                f"than a Code2Wav slot's voice prompt ({frames} frames = {frames / 50:g} s): "
                f"lower it or raise code2wav.engine.slot_prompt_frames")
        return self

    def stages(self) -> dict[str, StageSettings]:
        return {"thinker": self.thinker, "talker": self.talker, "code2wav": self.code2wav}


class MemoryBudgetError(RuntimeError):
    """The stages' memory caps plus CUDA contexts and graph reserves do not fit the GPU."""


def check_memory_budget(cfg: AppConfig, total_bytes: int, *, free_bytes: int | None = None,
                        stage: str | None = None) -> dict[str, float]:
    """Prove that every stage's cap + one CUDA context each + graph reserves fit the device.

    When `stage` and `free_bytes` are given, also check that this stage's own cap fits in
    what is free right now (one stage's check at a time; another stage may still be filling
    its cap, which the plan above leaves room for).
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


class CapacityError(RuntimeError):
    """A stage's memory holds fewer turns than the group's window (`capacity`)."""


# What to raise when a stage holds fewer turns than `capacity`.
_CAPACITY_HOLDERS = {
    "thinker": "thinker.kv_cache_gib (or cpu_kv_cache_gib on CPU)",
    "talker": "talker.memory_fraction",
    "code2wav": "code2wav.memory_fraction, or lower code2wav.engine.slot_prompt_frames",
}


def check_holds(stage: str, holds: dict[str, Any], capacity: int) -> None:
    """Refuse to start a stage whose memory holds fewer turns than the window lets in at
    once: past it, a turn the window admitted would find no room in the stage. `holds` is
    what the built engine reports: streams, stream_bytes, budget_bytes, holder."""
    if holds["streams"] >= capacity:
        return
    raise CapacityError(
        f"{stage} holds {holds['streams']} turns but capacity is {capacity}: its "
        f"{holds['holder']} has {holds['budget_bytes'] / GIB:.3f} GiB at "
        f"{holds['stream_bytes'] / 2**20:.1f} MiB a turn; raise "
        f"{_CAPACITY_HOLDERS.get(stage, 'its budget')} or lower capacity")


def dataclass_from_dict(cls: Any, values: dict[str, Any], where: str) -> Any:
    """A frozen config dataclass from YAML values: nested configs from nested dicts,
    lists as tuples, unknown keys refused with the known ones listed."""
    defaults = cls()
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{where}: unknown engine settings {unknown}; known: {sorted(names)}")
    kwargs = {}
    for k, v in values.items():
        current = getattr(defaults, k)
        if isinstance(v, dict) and dataclasses.is_dataclass(current):
            v = dataclass_from_dict(type(current), v, f"{where}.{k}")
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    return cls(**kwargs)
