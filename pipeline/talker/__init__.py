"""Talker: spoken-span ids + Thinker hidden states -> speech codes (25 per second).

model.py     TalkerModel (MiniCPMTTS layout) + TalkerKVCache
fused.py     its prefill / decode: joined projections, compiled on CUDA
rope_kv.py   the forward's RoPE + K / V cache write as one Triton kernel (CUDA)
sampling.py  the reference's code sampler, batched over streams
engine.py    TalkerEngine: slots, full_span / streaming units, 25(+3)-code chunks, CUDA graphs
"""

from pipeline.talker.engine import CodeChunk, TalkerEngine, TalkerEngineConfig, TalkerStats
from pipeline.talker.model import TalkerKVCache, TalkerModel
from pipeline.talker.sampling import TalkerSamplingParams

__all__ = ["CodeChunk", "TalkerEngine", "TalkerEngineConfig", "TalkerKVCache", "TalkerModel",
           "TalkerSamplingParams", "TalkerStats"]
