"""The names a recipe may choose for the LCSB core; torch-free, so a recipe validates without loading torch."""

SCHEDULES = ("cyclic", "reverse", "random", "adaptive")
UPPER_PATHS = ("identity", "exact", "suffix")
IDLE_UPDATES = ("momentum", "none")
LR_SCALES = ("none", "sqrt_k", "k")
ON_RETURN = ("keep", "reset")
