"""Training drafter heads for a target tokenleap runs: EAGLE-3 (Li et al., 2025) with
training-time test, on self-distilled data (`trainer.train_eagle3`, `tokenleap train-drafter`)."""
