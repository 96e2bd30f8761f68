"""The command line (`commands`; ``python -m parity``) and its progress display (`progress`)."""
