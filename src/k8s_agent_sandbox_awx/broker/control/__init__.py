"""The control plane: the claims logic both dialects share and the two front-ends (v1, /rpc)."""
