"""Design studies: the measurements that chose a default (scorer, compensation, calibration text, plan, recovery)."""
