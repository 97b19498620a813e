"""Talker: spoken-span ids + Thinker hidden states -> speech codes (25 per second).

model.py     TalkerModel (MiniCPMTTS layout) + TalkerKVCache
fused.py     the fused prefill / decode over the same weights (opt-in), optionally compiled
rope_kv.py   the fused forward's RoPE + K / V cache write as one Triton kernel (opt-in)
sampling.py  the reference's code sampler, batched over streams
graphs.py    CUDA graphs of the decode step
engine.py    TalkerEngine: slots, full_span / streaming units, 25(+3)-code chunks
"""

from pipeline.talker.engine import CodeChunk, TalkerEngine, TalkerEngineConfig, TalkerStats
from pipeline.talker.model import TalkerKVCache, TalkerModel
from pipeline.talker.sampling import TalkerSamplingParams

__all__ = [
    "CodeChunk",
    "TalkerEngine",
    "TalkerEngineConfig",
    "TalkerKVCache",
    "TalkerModel",
    "TalkerSamplingParams",
    "TalkerStats",
]
