"""Training drafter heads for a target tokenleap runs: EAGLE-3 (Li et al., 2025) with
training-time test, and Medusa-1 heads (Cai et al., 2024), on self-distilled data
(`trainer.train_drafter`, `tokenleap train-drafter`)."""
