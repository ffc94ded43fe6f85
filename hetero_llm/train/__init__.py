"""The training loop: one ranks steps from the first to train.steps, and what they report."""
