"""Verdicts: the step-0 sides (`parity.verdicts.sides`) and tolerance arithmetic
(`parity.verdicts.tolerance`) that `parity.step0` and `parity.diagnose` judge with."""
