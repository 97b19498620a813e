"""Full-duplex sessions on `WS /v1/realtime`: the official MiniCPM-o Realtime V1 wire
(`?mode=audio|video`) and vLLM-Omni's OpenAI-shaped one (`?duplex=1`), over one backend."""
