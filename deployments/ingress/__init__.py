"""The HTTP ingress: routes, request building (media, turns, the window), audio encoding, voices."""
