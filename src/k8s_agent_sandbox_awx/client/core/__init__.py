"""The operations as generators of steps, I/O-free: lifecycle, commands, files, uploads."""
