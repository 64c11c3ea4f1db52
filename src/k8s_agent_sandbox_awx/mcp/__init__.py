"""``agent-sandbox-awx mcp``: the Model Context Protocol server that gives agents sandboxes.

It is a client of the broker like any other (``AsyncSandbox``, its credential and broker found
as the SDK finds them); it imports the client, never the broker or ``testing``. The official
``mcp`` SDK (the ``[mcp]`` extra) is imported only by ``_server`` and ``_http``, when the
command runs: importing this package costs nothing. See docs/mcp.md.
"""
