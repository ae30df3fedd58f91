"""``tandem train-draft``: EAGLE-3 draft heads trained by self-distillation on the target's replies.

``prompts`` (seeded conversations), ``data`` (replies and hidden states through our engine),
``ttt`` (the training-time-test forward and loss), ``checkpoint`` (the speculators layout),
``trainer`` (the resumable pipeline).
"""
