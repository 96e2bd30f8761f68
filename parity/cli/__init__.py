"""The command line (`commands`; ``python -m parity``). Its argument forms and progress lines,
which lower layers use too, are `parity.core.flags` and `parity.core.progress`."""
