"""deployments.ingress.voices.VoiceStore: custom voices in memory and in a (shared) folder."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import threading
import time

import numpy as np
import pytest
import soundfile as sf

from deployments.ingress.schemas import ApiError
from deployments.ingress.voices import VoiceInfo, VoiceStore

SR = 16000


def sine(seconds: float = 1.0, rate: int = SR, freq: float = 220.0, channels: int = 1,
         amp: float = 0.3) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    x = (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    if channels == 1:
        return x
    return np.stack([x * (0.5 + 0.5 * c / channels) for c in range(channels)], axis=1)


def wav_bytes(x: np.ndarray, rate: int = SR, subtype: str = "FLOAT") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


@pytest.fixture(scope="module")
def clip() -> bytes:
    return wav_bytes(sine(1.0))


def status_of(excinfo) -> int:
    return excinfo.value.status


def new_store(folder, **kw) -> VoiceStore:
    kw.setdefault("max_seconds", 5.0)
    return VoiceStore(folder, **kw)


# -- basics -----------------------------------------------------------------------------


@pytest.mark.parametrize("persist", [False, True])
def test_add_get_list_delete(tmp_path, clip, persist):
    store = new_store(tmp_path / "v" if persist else None)
    info = store.add("alice", clip, consent="cons_123")
    assert isinstance(info, VoiceInfo)
    assert info.id.startswith("voice_") and len(info.id) == 6 + 24
    int(info.id[6:], 16)
    assert info.name == "alice" and info.consent == "cons_123"
    assert info.seconds == pytest.approx(1.0)
    assert abs(info.created_at - time.time()) < 60

    body = info.as_openai()
    assert body == {"id": info.id, "created_at": info.created_at, "name": "alice",
                    "object": "audio.voice", "type": "audio_sample",
                    "omniray": {"seconds": info.seconds}}
    assert info.as_openai_deleted() == {"id": info.id, "deleted": True,
                                        "object": "audio.voice.deleted"}

    by_name, s1 = store.get("alice")
    by_id, s2 = store.get(info.id)
    assert by_name == by_id == info
    assert s1.dtype == np.float32 and s1.ndim == 1 and s1.size == SR
    np.testing.assert_array_equal(s1, sine(1.0))  # 16 kHz float WAV in = same samples out
    np.testing.assert_array_equal(s1, s2)
    assert not s1.flags.writeable
    import hashlib
    assert info.sha256 == hashlib.sha256(s1.tobytes()).hexdigest()

    bob = store.add("bob", clip)
    assert [v.name for v in store.list()] == ["alice", "bob"]  # oldest first
    assert store.delete("alice") == info
    assert [v.id for v in store.list()] == [bob.id]
    assert store.delete(bob.id) == bob
    assert store.list() == []
    with pytest.raises(ApiError) as e:
        store.get("alice")
    assert status_of(e) == 404


def test_resample_stereo_44k(tmp_path):
    store = new_store(None)
    x = sine(1.0, rate=44100, channels=2)
    info, samples = store.get(store.add("stereo", wav_bytes(x, 44100, "PCM_16")).id)
    assert samples.ndim == 1 and samples.dtype == np.float32
    assert samples.size == int(np.ceil(x.shape[0] * SR / 44100))
    assert info.seconds == pytest.approx(samples.size / SR)


def test_unknown_and_delete_twice(tmp_path, clip):
    store = new_store(tmp_path)
    for key in ("nobody", "voice_" + "0" * 24, "", "../etc/passwd", None, 3):
        with pytest.raises(ApiError) as e:
            store.get(key)
        assert status_of(e) == 404 and e.value.param == "audio.voice"
        assert "does not exist" in e.value.message
    info = store.add("carol", clip)
    store.delete(info.id)
    for key in (info.id, "carol"):
        with pytest.raises(ApiError) as e:
            store.delete(key)
        assert status_of(e) == 404


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "x" * 65, "../x", "a/b", "voice_0123", "VOICE_abc",
                                  "voice_", "has space", ".hidden", "é", "a\n", None, 5])
def test_bad_names(clip, name):
    store = new_store(None)
    with pytest.raises(ApiError) as e:
        store.add(name, clip)
    assert status_of(e) == 400 and e.value.param == "name"


@pytest.mark.parametrize("name", ["a", "x" * 64, "My-Voice_2.0", "_x", "-x", "voice-1",
                                  "voice_xyz", "voices"])
def test_good_names(clip, name):
    assert new_store(None).add(name, clip).name == name


def test_duplicate_and_full(tmp_path, clip):
    store = new_store(tmp_path, max_voices=2)
    store.add("a", clip)
    with pytest.raises(ApiError) as e:
        store.add("a", clip)
    assert status_of(e) == 409 and e.value.param == "name"
    store.add("b", clip)
    with pytest.raises(ApiError) as e:
        store.add("c", clip)
    assert status_of(e) == 409 and "2" in e.value.message
    assert e.value.code == "voice_limit_reached"
    store.delete("a")
    store.add("c", clip)  # room again


@pytest.mark.parametrize("audio,status", [
    (b"", 400),
    (b"definitely not an audio file" * 10, 400),
    (b"RIFF\x00\x00\x00\x00WAVEjunk", 400),
])
def test_not_audio(audio, status):
    with pytest.raises(ApiError) as e:
        new_store(None).add("x", audio)
    assert status_of(e) == status and e.value.param == "audio_sample"


def test_too_long_and_too_short():
    store = new_store(None, max_seconds=2.0)
    with pytest.raises(ApiError) as e:
        store.add("long", wav_bytes(sine(2.5)))
    assert status_of(e) == 413 and e.value.param == "audio_sample"
    with pytest.raises(ApiError) as e:
        store.add("short", wav_bytes(sine(0.3)))
    assert status_of(e) == 400 and e.value.param == "audio_sample"
    assert store.add("ok", wav_bytes(sine(0.5))).seconds == pytest.approx(0.5)
    assert store.list()[0].name == "ok"


def test_bad_consent(clip):
    store = new_store(None)
    for consent in (7, "c" * 300):
        with pytest.raises(ApiError) as e:
            store.add("x", clip, consent=consent)
        assert status_of(e) == 400 and e.value.param == "consent"


# -- persistence ------------------------------------------------------------------------


def test_persistence_bit_exact(tmp_path):
    folder = tmp_path / "voices" / "nested"  # created if missing
    store = new_store(folder)
    noise = np.random.default_rng(0).uniform(-1, 1, SR + 123).astype(np.float32)
    a = store.add("noise", wav_bytes(noise), consent="yes")
    b = store.add("stereo", wav_bytes(sine(1.0, 44100, channels=2), 44100))
    _, sa = store.get("noise")
    _, sb = store.get("stereo")
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == sorted(
        [f"{a.id}.wav", f"{a.id}.json", f"{b.id}.wav", f"{b.id}.json"])
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp")]

    again = new_store(folder)
    assert again.list() == [a, b]
    ra, rb = again.get(a.id)[1], again.get("stereo")[1]
    assert ra.tobytes() == sa.tobytes() == noise.tobytes()
    assert rb.tobytes() == sb.tobytes()
    again.delete("noise")
    assert not (folder / f"{a.id}.wav").exists() and not (folder / f"{a.id}.json").exists()
    assert new_store(folder).list() == [b]


def test_in_memory_writes_nothing(tmp_path, clip, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = new_store(None)
    store.add("m", clip)
    store.delete("m")
    store.add("n", clip)
    assert list(tmp_path.iterdir()) == []
    assert new_store(None).list() == []


def test_restore_skips_broken_entries(tmp_path, clip, caplog):
    store = new_store(tmp_path)
    good = store.add("good", clip)
    corrupt = store.add("corrupt", clip)
    nowav = store.add("nowav", clip)
    badwav = store.add("badwav", clip)
    mismatch = store.add("mismatch", clip)
    (tmp_path / f"{corrupt.id}.json").write_text('{"id": "vo')  # truncated json
    (tmp_path / f"{nowav.id}.wav").unlink()
    (tmp_path / f"{badwav.id}.wav").write_bytes(b"RIFFxxxxWAVE")
    meta = json.loads((tmp_path / f"{mismatch.id}.json").read_text())
    meta["id"] = good.id
    (tmp_path / f"{mismatch.id}.json").write_text(json.dumps(meta))
    # stray files: an orphan wav, leftovers, other names, a directory that looks like an entry
    (tmp_path / ("voice_" + "a" * 24 + ".wav")).write_bytes(clip)
    (tmp_path / ".tmp-abc.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "voice_xyz.json").write_text("{}")
    (tmp_path / ("voice_" + "b" * 24 + ".json")).mkdir()
    (tmp_path / ("voice_" + "c" * 24 + ".json")).write_text("[1, 2]")
    with caplog.at_level(logging.WARNING, logger="deployments.ingress.voices"):
        restored = new_store(tmp_path)
    assert restored.list() == [good]
    assert restored.get("good")[0] == good
    skipped = " ".join(r.getMessage() for r in caplog.records)
    for v in (corrupt, nowav, badwav, mismatch):
        assert v.id in skipped
    for v in ("corrupt", "nowav", "badwav"):
        with pytest.raises(ApiError):
            restored.get(v)
    # a warning per broken entry, once: a re-scan does not re-read or re-warn
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deployments.ingress.voices"):
        restored.list()
        with pytest.raises(ApiError):
            restored.get("nobody")
    assert not caplog.records


def test_tampered_samples_are_dropped(tmp_path, clip):
    store = new_store(tmp_path)
    info = store.add("t", clip)
    x = sine(1.0, freq=440.0)  # same length and format, other content
    (tmp_path / f"{info.id}.wav").write_bytes(wav_bytes(x))
    other = new_store(tmp_path)
    assert [v.id for v in other.list()] == [info.id]  # the header is fine
    with pytest.raises(ApiError) as e:  # the samples are not what the json says
        other.get("t")
    assert status_of(e) == 404
    assert other.list() == []


# -- several stores on one folder (replicas) --------------------------------------------


def test_second_store_sees_adds_and_deletes(tmp_path, clip):
    a, b = new_store(tmp_path), new_store(tmp_path)
    v = a.add("shared", clip)
    assert b.get("shared")[0] == v  # unknown to b: re-scan
    assert b.get(v.id)[0] == v
    assert b.list() == [v]
    with pytest.raises(ApiError) as e:
        b.add("shared", clip)  # b re-scans before checking the name
    assert status_of(e) == 409

    a.delete(v.id)
    with pytest.raises(ApiError):
        b.get("shared")  # cached in b, files gone: dropped
    assert b.list() == []

    # same name re-added elsewhere under a new id: b follows
    w = a.add("shared", clip)
    b.get("shared")
    b.delete("shared")
    with pytest.raises(ApiError):
        a.get(w.id)
    with pytest.raises(ApiError) as e:
        a.delete(w.id)
    assert status_of(e) == 404

    # the voice count is shared too
    c = new_store(tmp_path, max_voices=1)
    a.add("one", clip)
    with pytest.raises(ApiError) as e:
        c.add("two", clip)
    assert status_of(e) == 409


def test_rescan_reads_only_new_files(tmp_path, clip, monkeypatch):
    a = new_store(tmp_path)
    for i in range(3):
        a.add(f"v{i}", clip)
    b = new_store(tmp_path)
    reads = []
    real = VoiceStore._read_entry
    monkeypatch.setattr(VoiceStore, "_read_entry",
                        lambda self, vid, sig: reads.append(vid) or real(self, vid, sig))
    b.list()
    b.get("v1")
    with pytest.raises(ApiError):
        b.get("nobody")
    assert reads == []
    new = a.add("v3", clip)
    assert [v.name for v in b.list()] == ["v0", "v1", "v2", "v3"]
    assert reads == [new.id]


def test_duplicate_names_on_disk_oldest_wins(tmp_path, clip):
    # two replicas that raced without a working lock: both entries land; the oldest wins
    a = new_store(tmp_path)
    first = a.add("dup", clip)
    second = a.add("other", clip)
    meta = json.loads((tmp_path / f"{second.id}.json").read_text())
    meta["name"] = "dup"
    (tmp_path / f"{second.id}.json").write_text(json.dumps(meta))
    b = new_store(tmp_path)
    assert b.list() == [first]
    assert b.get("dup")[0] == first
    assert b.get(second.id)[0].name == "dup"  # still reachable by id
    b.delete("dup")
    assert b.get("dup")[0].id == second.id


# -- threads ----------------------------------------------------------------------------


@pytest.mark.parametrize("persist", [False, True])
def test_concurrent_adds(tmp_path, clip, persist):
    store = new_store(tmp_path if persist else None, max_voices=64)
    errors, infos = [], []
    lock = threading.Lock()

    def work(t: int) -> None:
        for i in range(4):
            try:
                info = store.add(f"t{t}-{i}", clip)
                with lock:
                    infos.append(info)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    listed = store.list()
    assert len(listed) == 32 and len({v.id for v in listed}) == 32
    assert {v.name for v in listed} == {f"t{t}-{i}" for t in range(8) for i in range(4)}
    if persist:
        assert sorted(v.id for v in new_store(tmp_path).list()) == sorted(v.id for v in listed)


def test_concurrent_same_name_two_stores(tmp_path, clip):
    stores = [new_store(tmp_path), new_store(tmp_path)]
    ok, conflicts = [], []

    def work(i: int) -> None:
        try:
            ok.append(stores[i % 2].add("race", clip))
        except ApiError as e:
            conflicts.append(e.status)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ok) == 1 and conflicts == [409] * 7
    assert [v.id for v in new_store(tmp_path).list()] == [ok[0].id]
    assert len([p for p in os.listdir(tmp_path) if p.endswith(".json")]) == 1


# -- the HTTP routes' bounds ------------------------------------------------------------


def test_without_paths_keeps_the_file_name_only():
    from deployments.ingress.voices import without_paths

    msg = ("FileNotFoundError: [Errno 2] No such file or directory: "
           "'/root/.cache/omniray/ckpt/assets/campplus.onnx' (see ~/x/y.log, C:\\m\\a.bin)")
    assert without_paths(msg) == ("FileNotFoundError: [Errno 2] No such file or directory: "
                                  "'campplus.onnx' (see y.log, a.bin)")
    kept = "a/b and 1/2 stay, as does http://example.com/x"
    assert without_paths(kept) == kept


@pytest.fixture(scope="module")
def routes():
    from starlette.testclient import TestClient
    from test_api import light_source

    from fakes import build_local_app

    local = build_local_app({}, light_source())
    with TestClient(local.ingress.__serve_build_asgi_app__()) as client:
        yield local, client


def test_a_voice_upload_is_bounded_before_it_is_read(routes):
    from deployments.ingress.voices import max_upload_bytes

    local, client = routes
    limit = max_upload_bytes(local.ingress.cfg.limits.max_ref_audio_seconds)
    assert limit < local.ingress.cfg.limits.max_body_bytes
    app = client.app
    read = []

    async def post(n_chunks: int) -> int:  # streamed (chunked): no Content-Length
        async def receive():
            read.append(1)
            return {"type": "http.request", "body": b"x" * (1 << 20),
                    "more_body": len(read) < n_chunks}

        status = []

        async def send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])

        scope = {"type": "http", "method": "POST", "path": "/v1/audio/voices",
                 "raw_path": b"/v1/audio/voices", "query_string": b"", "root_path": "",
                 "scheme": "http", "server": ("t", 80), "client": ("c", 1),
                 "http_version": "1.1", "asgi": {"version": "3.0"},
                 "headers": [(b"content-type", b"multipart/form-data; boundary=xyz")]}
        await app(scope, receive, send)
        return status[0]

    headers = {"content-type": "multipart/form-data; boundary=xyz"}
    assert asyncio.run(post(100)) == 413
    assert len(read) <= limit // (1 << 20) + 2  # stopped reading soon past the limit
    declared = {**headers, "content-length": str(100 << 20)}
    r = client.post("/v1/audio/voices", content=b"", headers=declared)
    assert r.status_code == 413 and f"{100 << 20} bytes" in r.json()["error"]["message"]


def test_a_form_body_is_refused_as_not_json(routes):
    _, client = routes
    form = {"content-type": "application/x-www-form-urlencoded"}
    for url in ("/v1/chat/completions", "/v1/audio/voices"):
        r = client.post(url, content=b"model=omniray&name=x", headers=form)
        err = r.json()["error"]
        assert r.status_code == 415 and "JSON" in err["message"], (url, err)
        assert "not valid JSON" not in err["message"]
    # JSON text labelled as a form (curl -d) is still read as JSON
    r = client.post("/v1/chat/completions", content=b'{"messages": 5}', headers=form)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_voices_unavailable_names_no_server_path(routes):
    local, client = routes
    local.ingress._voice_support = (
        "FileNotFoundError: [Errno 2] No such file or directory: "
        "'/srv/models/MiniCPM-o-4_5/assets/token2wav/campplus.onnx'",)
    try:
        r = client.post("/v1/audio/voices", json={"name": "n", "audio_sample": "AAAA"})
    finally:
        local.ingress._voice_support = None
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "voices_unavailable"
    assert "campplus.onnx" in err["message"] and "/srv" not in err["message"]
