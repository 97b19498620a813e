"""Full-duplex sessions (MiniCPM-o 4.5's live mode): per-session Thinker and speech state,
unit by unit, exact to the reference `MiniCPMODuplex`."""
