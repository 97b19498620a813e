"""The harness against omniray's own ingress (in-process, fake engines, real request parsing and
media processing), served over HTTP on 127.0.0.1 by uvicorn: checks that the wire contract
of docs/bench.md holds end to end for the parts the server implements."""

from __future__ import annotations

import asyncio
import socket
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

testing = pytest.importorskip("fakes")
uvicorn = pytest.importorskip("uvicorn")

from bench.cli import main as cli_main  # noqa: E402
from bench.report import load_run  # noqa: E402


def _light_source() -> SimpleNamespace:
    """Config + tokenizer of the tiny preset, no weights (the fake engines need none)."""
    from pipeline.checkpoint import write_tokenizer
    from pipeline.config import (Code2WavConfig, ModelConfig, talker_config_from_hf,
                                 thinker_config_from_hf)
    from pipeline.presets import tiny_hf_config

    hf = tiny_hf_config()
    cfg = ModelConfig(thinker_config_from_hf(hf), talker_config_from_hf(hf), Code2WavConfig(), hf)
    path = Path(tempfile.mkdtemp(prefix="omniray-bench-tok-"))
    write_tokenizer(path, cfg.thinker.llm.vocab_size)
    return SimpleNamespace(config=cfg, path=path, tensors=None)


class _AppServer:
    """build_local_app behind uvicorn in a background thread (its own event loop)."""

    def __init__(self, cfg: dict) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cfg, self.source = cfg, _light_source()
        self.server: uvicorn.Server | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        local = testing.build_local_app(self.cfg, self.source)
        app = local.ingress.__serve_build_asgi_app__()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        await self.server.serve()

    def __enter__(self) -> "_AppServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (self.server is not None and self.server.started):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("in-process app did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.mark.parametrize("media", ["data", "file"])
def test_harness_against_inprocess_app(tmp_path, media):
    out, data = tmp_path / "out", tmp_path / "data"
    cfg = {"limits": {"max_tokens": 64}, "allowed_local_media_path": str(data.resolve())}
    with _AppServer(cfg) as srv:
        rc = cli_main(["run", "--url", f"http://127.0.0.1:{srv.port}", "--dataset", "synthetic",
                       "--media", media,
                       "--data-dir", str(data), "--synthetic-durations", "3",
                       "--synthetic-size", "64x64", "--synthetic-fps", "2",
                       "--concurrency", "1,2", "--num-prompts", "2", "--rounds", "1",
                       "--warmups", "1", "--fixed-text-tokens", "8", "--out", str(out),
                       "--no-plots", "--no-progress"])
    assert rc == 0
    run = load_run(out / "run.json")
    for c in ("1", "2"):
        s = run["summaries"][c]
        assert s["completed"] == 2 and s["failed"] == 0, s
    for rnd in run["rounds"]:
        for r in rnd["requests"]:
            assert r["ok"], r["error"]
            assert r["text"], "text deltas were parsed"
            assert r["audio_seconds"] > 0 and r["audio_events"], "audio chunks were parsed"
            assert 0 < r["ttft"] <= r["ttfp"] <= r["e2e"] + 1e-9
            # fixed-length fallback: ignore_eos + max_tokens = 8
            assert r["usage"]["completion_tokens"] == 8, r["usage"]
            if r["timings"] is not None:  # once the server returns per-stage timings
                assert all({"stage", "start", "end"} <= set(sp) for sp in r["timings"]["spans"])
