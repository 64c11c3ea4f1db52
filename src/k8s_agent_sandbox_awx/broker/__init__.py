"""The identity broker: routing, the request gate, the control and data planes."""
