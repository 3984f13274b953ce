"""Reproducible training of the learned injection scorer (see train_injection.py)."""
