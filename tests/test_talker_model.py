"""Talker model parity (CPU, fp32, tiny sizes): the plain forward (tests/_talker_ref.py) +
KV cache vs transformers LlamaModel, checkpoint key layout, weight-norm head, condition and
prompt building; the fused forward (fused.py) against the plain one, eager (bitwise) and
compiled (bounded)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from _talker_ref import PlainTalker, backbone
from transformers import DynamicCache, LlamaConfig, LlamaModel

from pipeline.config import TalkerConfig, talker_config_from_hf
from pipeline.presets import tiny_hf_config
from pipeline.talker import fused as fused_module
from pipeline.talker import rope_kv
from pipeline.talker.fused import FusedTalker
from pipeline.talker.model import AttentionBatch, TalkerKVCache, TalkerModel, WeightNormLinear

CPU = torch.device("cpu")


def tiny_cfg(**kw) -> TalkerConfig:
    # the released answer caps: the tiny default's short ones would end these runs early
    caps = {"min_new_tokens": TalkerConfig.min_new_tokens,
            "max_new_tokens": TalkerConfig.max_new_tokens}
    return replace(talker_config_from_hf(tiny_hf_config()), **{**caps, **kw})


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    diff = (actual.float() - expected.float()).abs()
    assert diff.max().item() <= tol, (
        f"{what}: max diff {diff.max().item():.3e}, mean diff {diff.mean().item():.3e}"
    )


def hf_llama(cfg: TalkerConfig) -> LlamaModel:
    hf_cfg = LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        num_hidden_layers=cfg.num_hidden_layers,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        vocab_size=cfg.backbone_vocab_size,
        attn_implementation="eager",
    )
    return LlamaModel(hf_cfg).eval()


def talker_and_hf(cfg: TalkerConfig, seed: int = 0) -> tuple[TalkerModel, LlamaModel]:
    torch.manual_seed(seed)
    talker = TalkerModel(cfg).eval()
    with torch.no_grad():  # larger-than-default norms so the parity is not trivially small
        for name, p in talker.model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    hf = hf_llama(cfg)
    backbone = {
        k[len("model.") :]: v for k, v in talker.state_dict().items() if k.startswith("model.")
    }
    hf.load_state_dict(backbone, strict=True)
    return talker, hf


CONFIGS = [
    pytest.param({"rope_theta": 500.0}, id="mha-theta500"),
    pytest.param(
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}, id="gqa-4q-2kv"
    ),
]


@pytest.mark.parametrize("overrides", CONFIGS)
@pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")  # transformers 5.x rename
@torch.no_grad()
def test_prefill_and_decode_match_transformers_llama(overrides):
    cfg = tiny_cfg(**overrides)
    talker, hf = talker_and_hf(cfg)
    cache = TalkerKVCache(cfg, slots=3, max_len=64, dtype=torch.float32, device=CPU)
    plain = PlainTalker(talker)
    slot, length = 1, 11
    prompt = torch.randn(length, cfg.hidden_size)

    # Full prompt: hidden states at every position and the last position's logits.
    positions = torch.arange(length)[None]
    batch = AttentionBatch(slice(slot, slot + 1), cache.row_ids[:1], positions, length, None)
    ours = backbone(talker, prompt[None], positions, cache, batch)
    ref = hf(inputs_embeds=prompt[None], position_ids=positions, use_cache=False).last_hidden_state
    assert_close(ours, ref, 2e-5, "prompt hidden states")
    cache.kv.zero_()
    logits = plain.prefill(cache, slot, prompt)
    assert_close(logits, talker.head(ref[0, -1]), 2e-5, "prefill logits")

    # Incremental steps: ours decodes rows [0, 3) with only `slot` active.
    other_rows = cache.kv[:, :, [0, 2]].clone()
    past = DynamicCache(config=hf.config)
    hf(inputs_embeds=prompt[None], position_ids=positions, past_key_values=past, use_cache=True)
    codes = torch.tensor([5, 17, 6561, 3, 3000])
    active = torch.tensor([False, True, False])
    for t, code in enumerate(codes.tolist()):
        pos = length + t
        batch_codes = torch.tensor([7, code, 9])
        batch_pos = torch.tensor([0, pos, 40])
        got = plain.decode(cache, batch_codes, batch_pos, active, read_len=32)
        emb = talker.embed_codes(torch.tensor([[code]]))
        out = hf(
            inputs_embeds=emb,
            position_ids=torch.tensor([[pos]]),
            past_key_values=past,
            use_cache=True,
        ).last_hidden_state
        assert_close(got[1], talker.head(out[0, -1]), 3e-5, f"decode step {t} logits")
    assert torch.equal(cache.kv[:, :, [0, 2], :, :64], other_rows[..., :64, :]), "idle slots' rows"


class _RefProjector(nn.Module):
    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(i, o)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(o, o)


class _RefTTS(nn.Module):
    """The reference MiniCPMTTS module tree (as built in the demo's __init__), for key layout."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.emb_text = nn.Embedding(cfg.num_text_tokens, cfg.hidden_size)
        self.model = hf_llama(cfg)
        self.projector_spk = _RefProjector(cfg.llm_dim, cfg.hidden_size)
        self.projector_semantic = _RefProjector(cfg.llm_dim, cfg.hidden_size)
        self.emb_code = nn.ModuleList([nn.Embedding(cfg.num_audio_tokens, cfg.hidden_size)])
        head = nn.Linear(cfg.hidden_size, cfg.num_audio_tokens, bias=False)
        self.head_code = nn.ModuleList([nn.utils.parametrizations.weight_norm(head, dim=0)])


@torch.no_grad()
def test_state_dict_keys_match_the_checkpoint_layout():
    cfg = tiny_cfg()
    torch.manual_seed(0)
    ref = _RefTTS(cfg)
    ours = TalkerModel(cfg)
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert sorted(our_sd) == sorted(ref_sd)
    for k, v in ref_sd.items():
        assert our_sd[k].shape == v.shape, k
    assert our_sd["head_code.0.parametrizations.weight.original0"].shape == (
        cfg.num_audio_tokens,
        1,
    )
    assert our_sd["model.embed_tokens.weight"].shape == (cfg.backbone_vocab_size, cfg.hidden_size)
    ours.load_state_dict(ref_sd, strict=True)
    h = torch.randn(3, cfg.hidden_size)
    # Loading re-materializes the head weight from the new (g, v).
    assert_close(ours.head(h), ref.head_code[0](h), 1e-6, "head after load_state_dict")


@torch.no_grad()
def test_weight_norm_head_matches_parametrizations_api():
    torch.manual_seed(0)
    lin = nn.Linear(16, 40, bias=False)
    ref = nn.utils.parametrizations.weight_norm(lin, dim=0)
    with torch.no_grad():
        ref.parametrizations.weight.original0.mul_(torch.rand(40, 1) * 3)  # g != ||v||
    ours = WeightNormLinear(16, 40)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(5, 16)
    assert_close(ours(x), ref(x), 0.0, "weight-norm head output")
    assert_close(ours._weight, ref.weight, 0.0, "materialized weight")
    ours.to(torch.float64)  # .to() rebuilds the weight from the converted (g, v)
    assert ours._weight.dtype == torch.float64
    assert_close(ours._weight, ref.weight, 1e-6, "weight after .to(float64)")


@torch.no_grad()
def test_condition_and_prompts_match_plain_restatement():
    cfg = tiny_cfg()
    torch.manual_seed(0)
    talker = TalkerModel(cfg).eval()
    ids = torch.tensor([151643, 5, 100, 151704, 7])
    hidden = torch.randn(5, cfg.llm_dim) * 4
    got = talker.build_condition(ids, hidden)
    proj = talker.projector_semantic
    h = F.relu(hidden @ proj.linear1.weight.T + proj.linear1.bias) @ proj.linear2.weight.T
    h = h + proj.linear2.bias
    h = h / h.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    expected = talker.emb_text.weight[ids] + h
    assert_close(got, expected, 1e-5, "condition rows")

    eos_row = talker.emb_text.weight[cfg.text_eos_token_id]
    bos_row = talker.emb_text.weight[cfg.audio_bos_token_id]
    offline = talker.offline_prompt(got)
    assert offline.shape == (7, cfg.hidden_size)
    assert torch.equal(offline[:5], got) and torch.equal(offline[5], eos_row)
    assert torch.equal(offline[6], bos_row)
    chunk = talker.streaming_prompt(got[:3], text_finished=False)
    assert chunk.shape[0] == 4 and torch.equal(chunk[3], bos_row)
    last = talker.streaming_prompt(got[3:], text_finished=True)
    assert last.shape[0] == 4 and torch.equal(last[2], eos_row) and torch.equal(last[3], bos_row)
    empty = talker.streaming_prompt(got[:0], text_finished=True)
    assert empty.shape[0] == 2

    no_norm = TalkerModel(replace(cfg, normalize_projected_hidden=False)).eval()
    no_norm.load_state_dict(talker.state_dict())
    unnormed = talker.emb_text.weight[ids] + proj(hidden)
    assert_close(no_norm.build_condition(ids, hidden), unnormed, 1e-5, "condition without L2 norm")


def test_kv_cache_budget_arithmetic():
    cfg = TalkerConfig()
    per_slot = TalkerKVCache.bytes_per_slot(cfg, 4096, torch.bfloat16)
    assert per_slot == 2 * 20 * 12 * 64 * 2 * 4097  # k+v, layers, heads, head_dim, bf16


# ---------------------------------------------------------------------------------------
# The fused forward


def run_both(cfg: TalkerConfig, plain, fused, dtype: torch.dtype, steps: int = 40):
    """The same prefills and decode steps (one idle row, read_len crossing a bucket) through
    `plain` and `fused`. Returns (pairs of logits, caches)."""
    caches = [TalkerKVCache(cfg, 4, 128, dtype, CPU) for _ in range(2)]
    pairs = []
    g = torch.Generator().manual_seed(3)
    lengths = (13, 5, 30)
    for slot, length in enumerate(lengths):
        embeds = torch.randn(length, cfg.hidden_size, generator=g).to(dtype)
        pairs.append([m.prefill(c, slot, embeds) for m, c in zip((plain, fused), caches)])
    positions = torch.tensor([*lengths, 0])
    active = torch.tensor([True, True, True, False])
    codes = torch.tensor([1, 2, 3, 4])
    for t in range(steps):
        read_len = 32 if t < 2 else 64  # step 2 crosses position 31 of the longest row
        out = [
            m.decode(c, codes, positions, active, read_len) for m, c in zip((plain, fused), caches)
        ]
        pairs.append([o[:3] for o in out])
        codes = out[0].argmax(-1)
        positions = positions + active.long()
    return pairs, caches


def random_talker(cfg: TalkerConfig, dtype: torch.dtype) -> TalkerModel:
    talker, _ = talker_and_hf(cfg)
    return talker.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("overrides", CONFIGS)
@torch.no_grad()
def test_fused_forward_equals_plain_bitwise(overrides, dtype):
    """Concatenated GEMMs, table RoPE, scatter writes and the once-built mask compute the
    plain path's numbers exactly on CPU: logits and every cache entry (the idle row's scratch
    column included) are bitwise equal, so the fused path inherits the transformers parity."""
    cfg = tiny_cfg(**overrides)
    talker = random_talker(cfg, dtype)
    fused = FusedTalker(copy.deepcopy(talker))
    assert not fused.compiled and not fused.rope_kernel  # the CPU's own choice
    pairs, (plain_cache, fused_cache) = run_both(cfg, PlainTalker(talker), fused, dtype)
    for i, (a, b) in enumerate(pairs):
        assert torch.equal(a, b), f"output {i}: max diff {(a - b).abs().max().item():.3e}"
    assert torch.equal(plain_cache.kv, fused_cache.kv)


@torch.no_grad()
def test_fuse_projections_keeps_checkpoint_names_and_one_copy():
    cfg = tiny_cfg()
    talker = random_talker(cfg, torch.float32)
    before = {k: v.clone() for k, v in talker.state_dict().items()}
    embeds = torch.randn(9, cfg.hidden_size)
    cache = TalkerKVCache(cfg, 1, 32, torch.float32, CPU)
    plain = PlainTalker(talker)
    plain_logits = plain.prefill(cache, 0, embeds)

    talker.fuse_projections()
    talker.fuse_projections()  # idempotent
    after = talker.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    attn, mlp = talker.model.layers[0].self_attn, talker.model.layers[0].mlp
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(attn.qkv_weight, qkv)
    assert torch.equal(mlp.gate_up_weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    # The Linears view the concatenated weights: one copy of the weights.
    assert attn.v_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.data_ptr()
    # The plain path on a fused model computes what it computed before.
    assert torch.equal(plain.prefill(cache, 0, embeds), plain_logits)

    # Loading (by the checkpoint's names) lands in the concatenated weights.
    other = TalkerModel(cfg).state_dict()
    talker.load_state_dict(other, strict=True)
    prefix = "model.layers.1."
    expected = torch.cat([other[prefix + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(talker.model.layers[1].self_attn.qkv_weight, expected)
    talker.load_state_dict(before, strict=True, assign=True)  # new Parameters: fused again
    assert torch.equal(attn.qkv_weight, qkv)
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.data_ptr()
    # .to() converts each Parameter; the concatenation is rebuilt from them.
    talker.to(torch.float64)
    assert attn.qkv_weight.dtype == torch.float64 and torch.equal(attn.qkv_weight, qkv.double())
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.data_ptr()


# Inductor keeps the bf16 roundings (emulate_precision_casts) but sums the norms' squares in
# its own order and computes SiLU its own way: about one bf16 step of the logits.
COMPILED_BOUND = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-7}  # bf16: x max |logit|


needs_rope_kernel = pytest.mark.skipif(
    not rope_kv.runs_here(CPU), reason="the RoPE kernel needs Triton (its interpreter on CPU)"
)


@needs_rope_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_rope_kv_kernel_forward_equals_plain_bitwise(dtype):
    """The fused forward with its rotation and K / V write as one Triton kernel (run in the
    interpreter) rounds where the torch ops round: logits and every cache entry (the idle
    row's scratch column included) bitwise the plain path's, in fp32 and in bf16."""
    cfg = tiny_cfg()
    talker = random_talker(cfg, dtype)
    fused = FusedTalker(copy.deepcopy(talker), rope_kernel=True)
    pairs, (plain_cache, fused_cache) = run_both(cfg, PlainTalker(talker), fused, dtype, steps=12)
    for i, (a, b) in enumerate(pairs):
        assert torch.equal(a, b), f"output {i}: max diff {(a - b).abs().max().item():.3e}"
    assert torch.equal(plain_cache.kv, fused_cache.kv)


@needs_rope_kernel
@torch.no_grad()
def test_rope_kv_kernel_rounds_bf16_to_nearest_even():
    """The kernel's bf16 roundings are torch's (to nearest, ties to even) on values built to
    land on halfway points: odd integers times table entries 1 + k / 128 (k odd) need one bit
    more than bf16 holds, so most products and sums are ties, where a truncating cast
    differs. K and v land in the cache at their write positions."""
    cfg = tiny_cfg()
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cache = TalkerKVCache(cfg, 3, 16, torch.bfloat16, CPU)
    g = torch.Generator().manual_seed(5)

    def odd(*shape: int, below: int) -> torch.Tensor:  # +-1, +-3, ... up to below - 1
        sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
        return sign * (torch.randint(0, below // 2, shape, generator=g) * 2 + 1)

    table = (odd(17, 2, d, below=128) / 128 + torch.sign(odd(17, 2, d, below=2))).to(torch.bfloat16)
    qkv = odd(2, 3, h + 2 * hkv, d, below=8).to(torch.bfloat16)
    positions = torch.tensor([[3, 4, 5], [0, 1, 2]])
    write_pos = torch.tensor([[7, 8, 9], [10, 11, 12]])
    cs = table[positions][:, :, None]  # (B, L, 1, 2, D)
    qk = qkv[:, :, : h + hkv]
    expected = qk * cs[..., 0, :] + qk.roll(d // 2, dims=-1) * cs[..., 1, :]

    def truncated(x: torch.Tensor) -> torch.Tensor:  # fp32 -> bf16 by dropping bits
        return (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

    f32 = [t.float() for t in (qk, cs[..., 0, :], cs[..., 1, :])]
    chopped = truncated(truncated(f32[0] * f32[1]).float()
                        + truncated(qk.roll(d // 2, dims=-1).float() * f32[2]).float())
    assert not torch.equal(chopped, expected)  # the inputs do test the rounding

    out = rope_kv.rope_kv_(qkv.clone(), table, positions, write_pos, cache.kv[0], 1, h, hkv)
    assert torch.equal(out[:, :, : h + hkv], expected)
    assert torch.equal(out[:, :, h + hkv :], qkv[:, :, h + hkv :])  # v passes through
    k_cache = cache.kv[0, 0].permute(0, 2, 1, 3)  # (S, T, Hkv, D)
    v_cache = cache.kv[0, 1].permute(0, 2, 1, 3)
    slots = torch.tensor([[1], [2]])  # row0 = 1
    assert torch.equal(k_cache[slots, write_pos], expected[:, :, h:])
    assert torch.equal(v_cache[slots, write_pos], qkv[:, :, h + hkv :])
    untouched = torch.ones(3, 17, dtype=torch.bool)
    untouched[slots, write_pos] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize(
    "dtype,rope_kernel",
    [
        (torch.float32, False),
        (torch.bfloat16, False),
        pytest.param(torch.bfloat16, True, marks=needs_rope_kernel),
    ],
    ids=["fp32", "bf16", "bf16-rope-kernel"],
)
@torch.no_grad()
def test_compiled_fused_forward_within_bound_and_few_graphs(dtype, rope_kernel):
    torch._dynamo.reset()  # count this test's graphs only
    cfg = tiny_cfg()
    talker = random_talker(cfg, dtype)
    fused = FusedTalker(copy.deepcopy(talker), compile=True, rope_kernel=rope_kernel)
    pairs, _ = run_both(cfg, PlainTalker(talker), fused, dtype)
    scale = max(a.abs().max().item() for a, _ in pairs)
    bound = COMPILED_BOUND[dtype] * (scale if dtype == torch.bfloat16 else 1.0)
    worst = max((a - b).abs().max().item() for a, b in pairs)
    assert worst <= bound, f"compiled vs plain: max diff {worst:.3e} > {bound:.3e}"
    # One graph per function for prefills of any length (rows 1) and one for decodes of any
    # row count, reused by all layers and read lengths (TalkerEngine also decodes rows 1:
    # a third).
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    for fn in (fused_module.first_attn_pre, fused_module.attn_pre, fused_module.mlp_post,
               fused_module.final_norm):
        assert len(_debug_get_cache_entry_list(fn.__code__)) == 2, fn.__name__
