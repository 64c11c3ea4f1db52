"""The command line (``agent-sandbox-awx``) and doctor."""
