"""Who may call the broker: token verification, trusted issuers, policy and callers."""
