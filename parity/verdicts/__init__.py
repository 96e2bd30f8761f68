"""Verdicts: the step-0 sides (`parity.verdicts.sides`) and tolerance arithmetic
(`parity.verdicts.tolerance`) that `parity.verdicts.step0` and `parity.verdicts.diagnose` judge with."""
