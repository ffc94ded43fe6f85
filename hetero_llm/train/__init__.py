"""The training loop: one rank's steps from the first to train.steps, and what they report."""
