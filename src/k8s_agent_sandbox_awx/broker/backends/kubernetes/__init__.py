"""The Kubernetes backend: SandboxClaims on a Kubernetes API server."""
