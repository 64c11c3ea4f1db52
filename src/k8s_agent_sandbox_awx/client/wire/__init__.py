"""What goes on the wire, I/O-free: requests, replies, JSON/NDJSON, redaction, dialects."""
