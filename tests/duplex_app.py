"""The ingress with its duplex sessions on tests/fakes.py's FakeDuplexBackend, and the app
around it on Serve (fake stage engines: duplex sessions never touch the stages)."""

from __future__ import annotations

from typing import Any

from deployments.ingress.server import IngressServer
from fakes import FakeDuplexBackend


class FakeDuplexIngress(IngressServer):
    """`duplex_backend` kwargs script the fake backend (the ingress's `stats()` folds in the
    duplex manager's invariants); `duplex_backend_log()` shows what the backend got."""

    def __init__(self, *args: Any, duplex_backend: dict | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        from deployments.duplex.manager import DuplexManager

        self.duplex = DuplexManager(self.cfg.duplex, FakeDuplexBackend(**(duplex_backend or {})))

    async def duplex_backend_log(self) -> dict[str, Any]:
        b = self.duplex.backend
        return {"inits": {k: {"mode": v.mode, "system_prompt": v.system_prompt,
                              "max_slice_nums": v.max_slice_nums, "audio_out": v.audio_out,
                              "options": v.options,
                              "ref_audio": None if v.ref_audio is None else len(v.ref_audio)}
                          for k, v in b.inits.items()},
                "units": {k: list(v) for k, v in b.units.items()},
                "open": sorted(b.sessions), "opened": b.opened, "closed": b.closed}


def build_duplex_app(cfg: dict, duplex_backend: dict | None = None) -> Any:
    """The app of `cfg` with FakeDuplexIngress as its ingress and fake stage engines."""
    from ray import serve

    from deployments.config import AppConfig
    from deployments.stages.code2wav import Code2WavServer
    from deployments.stages.talker import TalkerServer
    from deployments.stages.thinker import ThinkerServer
    from fakes import FakeCode2WavEngine, FakeTalkerEngine, FakeThinkerEngine

    args = AppConfig.model_validate(cfg).model_dump()
    cpu0 = {"ray_actor_options": {"num_cpus": 0}}  # the session's Ray has 2 CPUs
    c2w = serve.deployment(Code2WavServer, name="Code2Wav", **cpu0).bind(
        args, engine_cls=FakeCode2WavEngine)
    talker = serve.deployment(TalkerServer, name="Talker", **cpu0).bind(
        args, c2w, engine_cls=FakeTalkerEngine)
    thinker = serve.deployment(ThinkerServer, name="Thinker", **cpu0).bind(
        args, talker, engine_cls=FakeThinkerEngine)
    ingress = serve.deployment(serve.ingress()(FakeDuplexIngress), name="Ingress", **cpu0)
    return ingress.bind(args, thinker, talker, c2w, duplex_backend=duplex_backend)
