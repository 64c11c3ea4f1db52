"""The broker's backends: where the sandboxes it hands out live."""
