"""Golden trajectories: the file format (`format`), export from torch (`export`) and the check of
the JAX side without torch (`check`)."""
