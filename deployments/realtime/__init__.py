"""omniray's OpenAI Realtime endpoint (`WS /v1/realtime`): protocol, session, turn detection."""
