"""Offline tools, never imported on the per-token path: calibrate, profile, train-predictor,
perplexity, bench, and the calibration text they read (corpus). They reach the engine only
through `observe`."""
