"""Training utilities: the optimizer (:mod:`.optim`)."""
