"""Runs the official `MiniCPMODuplex` on the duplex test checkpoint and writes the golden files
that tests/test_duplex_parity.py compares omniray against.

    python tests/duplex_golden/make_golden.py /path/to/minicpm-o-4_5-pytorch-simple-demo \
        [--fit] [--out tests/duplex_golden] [--publish /work/duplex/golden]

The demo checkout (a work tree or a bare git mirror) is read at that path, never copied into
the project; the commit it used is printed and written into every golden's json. How the
reference is loaded on CPU in float32, and what is patched at load time: load_ref.py. Needs
transformers 4.51.0 in its own folder (load_ref.INSTALL_HINT; or point
$OMNIRAY_REF_TRANSFORMERS at one) and minicpmo-utils 1.0.7 (the README's test install).
About 1.5 min on one CPU core for the five sessions (35 s more with --fit).

--fit first refits the test checkpoint's patch (tests/_duplex_ckpt.py says what it does) on
the reference with the tiny default, and writes ckpt_patch.npz; without it the committed
patch is used. Each session runs on a fresh reference object (the reference keeps its
streaming audio encoder's cache across `prepare`; omniray isolates sessions).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

import load_ref  # noqa: E402  (before anything imports transformers)

SPEAK, LISTEN, TTS_BOS, TURN_EOS, CHUNK_TTS_EOS = 151706, 151705, 151703, 151717, 151721
# The fitted patch's scales (see fit_patch): the loud/quiet detector's gain and threshold,
# the audio projection's gain on the two decision directions, the embedding offsets of
# <|tts_bos|> / <|turn_eos|>, and the output rows' gain.
FIT = {"alpha": 1.0, "threshold": 0.3, "beta": 10.0, "embed": 10.0, "row": 0.3,
       "direction_seed": 45}


def fit_patch(demo: str) -> dict:
    """Fits the test checkpoint's patch on the reference run over the tiny default: a linear
    loud-vs-quiet detector (Fisher LDA on the audio projection's inputs of the scripted
    units) feeds two hidden units of the audio projection (ReLU gated, one per class), which
    write a speak / a quiet direction into the audio embeddings; the `<|speak|>` and
    `<|listen|>` output rows read those directions; `<|tts_bos|>`'s and `<|turn_eos|>`'s
    embeddings carry directions that the `<|turn_eos|>` and `<|chunk_tts_eos|>` rows read."""
    import torch

    from tests import _duplex_inputs as di

    base = _default()
    feats = {"L": [], "q": []}
    for script in di.SESSIONS:
        ref = load_ref.load_reference(demo, base, generate_audio=False)
        seen = []
        ref.model.audio_projection_layer.register_forward_hook(
            lambda m, i, o: seen.append(i[0].detach().reshape(-1, i[0].shape[-1]).clone()))
        ref.prepare(prefix_system_prompt=di.PREFIX, suffix_system_prompt=di.SUFFIX)
        for kind, (audio, frames) in zip(script.pattern, di.session_inputs(script)):
            seen.clear()
            ref.streaming_prefill(audio_waveform=audio, frame_list=frames)
            feats[kind].append(seen[0])
            ref.streaming_generate(decode_mode="greedy", max_new_speak_tokens_per_chunk=2)
    loud, quiet = torch.cat(feats["L"]), torch.cat(feats["q"])
    mu = loud.mean(0) - quiet.mean(0)
    cov = torch.cov(torch.cat([loud - loud.mean(0), quiet - quiet.mean(0)]).T)
    w = torch.linalg.solve(cov + 1e-3 * torch.eye(cov.shape[0]), mu)
    w = w / w.norm()

    get = _tensor_reader(base)
    emb = get("llm.model.embed_tokens.weight")
    w1 = get("audio_projection_layer.linear1.weight")
    b1 = get("audio_projection_layer.linear1.bias")
    w2 = get("audio_projection_layer.linear2.weight")
    g = torch.Generator().manual_seed(FIT["direction_seed"])
    q, _ = torch.linalg.qr(torch.randn(emb.shape[1], 4, generator=g))
    d_speak, d_quiet, d_turn, d_end = q.T
    a, t, beta, e, r = FIT["alpha"], FIT["threshold"], FIT["beta"], FIT["embed"], FIT["row"]
    w1, b1, w2 = w1.clone(), b1.clone(), w2.clone()
    w1[0], b1[0] = a * w, -a * t
    w1[1], b1[1] = -a * w, a * t
    w2[:, 0], w2[:, 1] = beta * d_speak, beta * d_quiet
    return {
        "audio_projection_layer.linear1.weight": {"rows": {0: w1[0].numpy(), 1: w1[1].numpy()}},
        "audio_projection_layer.linear1.bias": {"full": b1.numpy()},
        "audio_projection_layer.linear2.weight": {"cols": {0: w2[:, 0].numpy(),
                                                           1: w2[:, 1].numpy()}},
        "llm.model.embed_tokens.weight": {"rows": {
            TTS_BOS: (emb[TTS_BOS] + e * d_turn).numpy(),
            TURN_EOS: (emb[TURN_EOS] + e * d_end).numpy()}},
        "llm.lm_head.weight": {"rows": {
            SPEAK: (r * d_speak).numpy(), LISTEN: (r * d_quiet).numpy(),
            TURN_EOS: (r * d_turn).numpy(), CHUNK_TTS_EOS: (r * d_end).numpy()}},
    }


def _default():
    from pipeline.checkpoint import default_checkpoint

    return default_checkpoint()


def _tensor_reader(ckpt: Path):
    from safetensors import safe_open

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]

    def get(name):
        with safe_open(str(ckpt / index[name]), "pt") as f:
            return f.get_tensor(name).float()

    return get


def run_session(demo: str, ckpt: Path, script) -> tuple[dict, dict]:
    """One scripted session on a fresh reference: (json-able record, npz arrays)."""
    import torch

    ref = load_ref.load_reference(demo, ckpt, generate_audio=script.generate_audio,
                                  n_timesteps=script.n_timesteps, **script.duplex_kwargs)
    codes_box: list = []
    gen_chunk = ref.model.tts.generate_chunk

    def generate_chunk(*a, **k):
        out = gen_chunk(*a, **k)
        codes_box.append(out[0].reshape(-1).tolist())
        calls.append({"condition_len": int(k["inputs_embeds"].shape[1]),
                      "text_start_pos": int(k["text_start_pos"]),
                      "min_new_tokens": int(k["min_new_tokens"]),
                      "max_new_token": int(k["max_new_token"])})
        return out

    ref.model.tts.generate_chunk = _no_global_draws(generate_chunk, "the Talker")
    t2w = ref.model.tts.audio_tokenizer
    stream = _no_global_draws(t2w.stream, "Token2wav")

    def logged_stream(tokens, prompt_wav=None, last_chunk=False, return_waveform=False):
        out = stream(tokens, prompt_wav=prompt_wav, last_chunk=last_chunk,
                     return_waveform=return_waveform)
        samples = len(out) // 2 if isinstance(out, bytes) else int(out.shape[-1])
        t2w_calls.append([[int(t) for t in tokens], bool(last_chunk), samples])
        return out

    t2w.stream = logged_stream
    calls: list = []
    t2w_calls: list = []
    prefill = _no_global_draws(ref.streaming_prefill, "streaming_prefill")
    # Count the global-RNG draws (StreamDecoder.decode's torch.multinomial: the only ones).
    draws = [0]
    multinomial = torch.multinomial

    def counting_multinomial(*a, **k):
        draws[0] += 1
        return multinomial(*a, **k)

    torch.multinomial = counting_multinomial
    try:
        return _run_units(ref, script, ckpt, prefill, codes_box, draws, calls, t2w_calls)
    finally:
        torch.multinomial = multinomial


def _no_global_draws(fn, what):
    """`fn`, asserting that it leaves the global torch RNG as it found it."""
    import torch

    def run(*a, **k):
        state = torch.get_rng_state()
        out = fn(*a, **k)
        assert torch.equal(state, torch.get_rng_state()), f"{what} drew from the global RNG"
        return out

    return run


def _run_units(ref, script, ckpt, prefill, codes_box, draws, talker_calls, t2w_calls):
    import numpy as np
    import torch

    from tests import _duplex_inputs as di

    dec = ref.decoder
    torch.manual_seed(script.seed)
    prepare = _no_global_draws(ref.prepare, "prepare")
    prepare(prefix_system_prompt=di.PREFIX, suffix_system_prompt=di.SUFFIX,
            ref_audio=di.ref_audio(ckpt), prompt_wav_path=ref.omniray_prompt_wav)
    record = {
        "name": script.name, "decode_mode": script.decode_mode, "seed": script.seed,
        "pattern": script.pattern, "frames": script.frames,
        "frame_size": list(script.frame_size), "duplex_kwargs": script.duplex_kwargs,
        "generate_audio": script.generate_audio, "n_timesteps": script.n_timesteps,
        "prefix": di.PREFIX, "suffix": di.SUFFIX,
        "prefix_ids": ref.tokenizer.encode(di.PREFIX, add_special_tokens=False),
        "suffix_ids": ref.tokenizer.encode(di.SUFFIX, add_special_tokens=False),
        "prepare_cache_len": dec.get_cache_length(),
        "system_preserve_len": dec._system_preserve_length,
        "units": [],
    }
    arrays: dict[str, np.ndarray] = {}
    for i, (audio, frames) in enumerate(di.session_inputs(script)):
        n_ids = len(ref.total_ids)
        hidden_before = len(ref.total_hidden)
        ok = prefill(audio_waveform=audio, frame_list=frames)
        assert ok["success"], ok
        codes_box.clear()
        talker_calls.clear()
        t2w_calls.clear()
        draws[0] = 0
        out = ref.streaming_generate(decode_mode=script.decode_mode)
        generated = ref.total_ids[n_ids:]
        spoken = ref.total_hidden[hidden_before] if len(ref.total_hidden) > hidden_before else []
        codes = codes_box[0] if codes_box else []
        pcm = out["audio_waveform"]
        unit = {
            "index": i, "kind": script.pattern[i],
            "prefill": [list(x) if isinstance(x, tuple) else x
                        for x in ref.prefill_schema_tokens[-1]],
            "generated": generated,
            "is_listen": bool(out["is_listen"]), "end_of_turn": bool(out["end_of_turn"]),
            "text": out["text"],
            "codes": codes, "talker_called": bool(codes_box),
            "pcm": None if pcm is None else int(len(pcm)),
            "spoken_ids": [int(s[0]) for s in spoken],
            "cache_len": dec.get_cache_length(),
            "position_offset": int(dec._position_offset),
            "slides": int(dec._sliding_event_count),
            "dropped_units": int(dec._total_dropped_units),
            "tts_text_start_pos": int(ref.tts_text_start_pos),
            "token2wav_buffer": list(ref.token2wav_buffer),
            "rng_draws": draws[0],
            "talker_call": talker_calls[0] if talker_calls else None,
            "token2wav_calls": [list(c) for c in t2w_calls],
        }
        if script.duplex_kwargs.get("sliding_window_mode") == "context":
            unit.update({
                "previous_text": dec._previous_text,
                "previous_token_ids": list(dec._previous_token_ids),
                "previous_content_len": int(dec._previous_content_length),
                "preserve_prefix_len": int(dec._preserve_prefix_length),
                "unit_history": [h["unit_id"] for h in dec._unit_history],
            })
        record["units"].append(unit)
        if pcm is not None:
            # the reference's PCM is int16 / 32768 (Token2wav's bytes): stored losslessly
            q = np.round(np.asarray(pcm, dtype=np.float64) * 32768.0)
            assert np.array_equal(q / 32768.0, np.asarray(pcm, dtype=np.float64))
            arrays[f"pcm_{i}"] = q.astype(np.int16)
        if spoken:
            arrays[f"spoken_hidden_{i}"] = torch.cat(
                [s[1].reshape(1, -1) for s in spoken]).float().numpy()
    record["total_ids"] = list(ref.total_ids)
    record["res_ids"] = list(ref.res_ids)
    record["generated_text"] = ref.get_generated_text()
    return record, arrays


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("demo", help="the OpenBMB/minicpm-o-4_5-pytorch-simple-demo checkout")
    ap.add_argument("--fit", action="store_true", help="refit ckpt_patch.npz first")
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--publish", default=None, help="also copy the goldens here")
    ap.add_argument("--only", default=None, help="comma-separated session names")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    torch.set_num_threads(1)
    from tests import _duplex_ckpt as dc
    from tests import _duplex_inputs as di

    commit = load_ref.demo_commit(args.demo)
    print(f"demo commit: {commit}", flush=True)
    t0 = time.time()
    if args.fit:
        patch = fit_patch(args.demo)
        dc.save_patch(HERE / dc.PATCH_FILE, patch)
        print(f"fitted {dc.PATCH_FILE} in {time.time() - t0:.0f} s", flush=True)
    ckpt = dc.duplex_test_checkpoint()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else [s.name for s in di.SESSIONS]
    for name in names:
        t1 = time.time()
        record, arrays = run_session(args.demo, ckpt, di.session(name))
        record["demo_commit"] = commit
        record["patch_digest"] = dc.patch_digest(dc.load_patch())
        record["run_seconds"] = round(time.time() - t1, 1)
        (out / f"{name}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        np.savez_compressed(out / f"{name}.npz", **arrays)
        events = "".join("L" if u["is_listen"] else ("E" if u["end_of_turn"] else "S")
                         for u in record["units"])
        print(f"{name}: units {events} slides {record['units'][-1]['slides']} "
              f"in {record['run_seconds']} s", flush=True)
    print(f"total {time.time() - t0:.0f} s", flush=True)
    if args.publish:
        pub = Path(args.publish)
        pub.mkdir(parents=True, exist_ok=True)
        for p in out.iterdir():
            if p.suffix in (".json", ".npz", ".md") and p.is_file():
                shutil.copy2(p, pub / p.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
