"""The Ray Serve apps the Ray tests deploy on the session's one local Ray (conftest.py
`ray_http`), with the real engines on the embedded tiny default unless they say otherwise.
"""

from __future__ import annotations

import tempfile

APP = "omniray"
WINDOW = 2
MEDIA_DIR = tempfile.mkdtemp(prefix="omniray-serve-media-")
VOICES_DIR = tempfile.mkdtemp(prefix="omniray-serve-voices-")
# Small Talker units so the random tiny model's speech stays short on 2 CPU cores.
APP_CONFIG = {
    "capacity": WINDOW,
    "request_timeout_s": 120,
    "allowed_local_media_path": MEDIA_DIR,
    "voices_dir": VOICES_DIR,
    "limits": {"max_tokens": 64, "default_max_tokens": 12, "max_images": 4},
}
