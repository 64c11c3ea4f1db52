"""What both planes share: the request gate, the error answers, the observed-request hooks,
the route names, the metadata rules."""
