"""Token sampling: one rule set (``rules.py``) over a numpy or a torch array backend."""
